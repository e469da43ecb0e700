"""How long a client may take: a request's headers, its body, and an idle keep-alive connection.

A connection that sends its request slowly, or stops halfway, holds a socket and (past the headers)
an ASGI task; without a deadline a few hundred of them stay open forever. Three deadlines, each
from ``ServerConfig``:

    connect / last response ──── headers ────┬──── body ────┬─── handler ───
    |<-- header_read_timeout_s ------------->|              |   (no limit: generation takes as long as it takes)
    |<-- body_read_timeout_s (from the request's start) --->|
    idle keep-alive: closed after keep_alive_timeout_s (uvicorn's own timer)

- Headers (``HeaderTimeoutH11Protocol``): uvicorn has no header timeout, so its h11 protocol is
  subclassed: past the deadline with no complete request, the connection is closed (there is no
  request to answer yet). It never closes a connection while a request is being served.
- Body (``BodyReadTimeoutMiddleware``): a request whose body has not fully arrived in time gets a
  408 in OpenAI's error schema with ``Connection: close``. Once the body is in, ``receive`` is
  the server's again (handlers wait on it for a disconnect).
"""

from __future__ import annotations

import asyncio
from typing import Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

from kiln.config import ServerConfig
from kiln.entrypoints.openai.errors import error_response


def uvicorn_options(server: ServerConfig) -> dict:
    """Keyword arguments for ``uvicorn.Config`` that apply the server's connection deadlines."""
    return {
        "timeout_keep_alive": server.keep_alive_timeout_s,
        "http": header_timeout_protocol(server.header_read_timeout_s),
    }


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with this header deadline (uvicorn builds one protocol per connection)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": timeout_s})


class HeaderTimeoutH11Protocol(H11Protocol):
    """Closes a connection whose next request's headers are not complete within ``header_timeout_s``
    of the connection opening or of the request's first byte."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._header_timer: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        between_requests = cycle is None or cycle.response_complete
        super().data_received(data)
        if self.cycle is not cycle:
            self._cancel_header_timer()  # a new request's headers are complete
        elif between_requests:
            self._arm_header_timer()  # the first bytes of the next request: its clock starts

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served (its body has its own deadline)
        if not self.transport.is_closing():
            self.transport.close()


class BodyReadTimeoutMiddleware:
    """A 408 (connection closed) for a request whose body has not arrived ``timeout_s`` after it began."""

    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False
        started = False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise _BodyTimeout() from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, watched_send)
        except _BodyTimeout:
            if started:
                raise
            refusal = error_response(408, f"the request body did not arrive within {self.timeout_s:g} s "
                                          "(server.body_read_timeout_s)", None, "request_timeout",
                                     {"Connection": "close"})
            await refusal(scope, receive, send)


class _BodyTimeout(Exception):
    """Raised through the app from ``receive`` when the body's deadline passes."""
