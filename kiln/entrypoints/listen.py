"""The server's listening socket, bound before anything slow starts (this module imports nothing heavy)."""

from __future__ import annotations

import errno
import socket

_BIND_HINTS = {
    errno.EADDRINUSE: "another process listens there: stop it or choose another server.port",
    errno.EACCES: "ports below 1024 need privileges: choose a server.port of 1024 or more",
    errno.EADDRNOTAVAIL: "this machine has no such address: choose another server.host (0.0.0.0: every interface)",
}


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the model loads, so a port in use, a
    privileged port or an address this machine lacks is a ValueError saying what to change at once
    rather than uvicorn's error after the whole start-up."""
    # As uvicorn binds: IPv6 for an address with a colon, else IPv4 (a name resolves to its IPv4
    # address); SO_REUSEADDR, so a restart takes the port straight back.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:  # socket.gaierror too: a name that does not resolve
        sock.close()
        hint = _BIND_HINTS.get(e.errno, "choose another server.host or server.port")
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}; {hint}") from None
    return sock
