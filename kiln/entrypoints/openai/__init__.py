"""The OpenAI-compatible server: routes (api_server), wire format (protocol), one handler per
endpoint family (serving_completions, serving_chat) over shared helpers (serving), errors in
OpenAI's schema (errors) and Prometheus metrics (metrics)."""

from kiln.entrypoints.openai.api_server import build_app, run_server

__all__ = ["build_app", "run_server"]
