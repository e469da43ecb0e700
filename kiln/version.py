"""The package version: one place, read by the package root and the server."""

__version__ = "0.1.0"
