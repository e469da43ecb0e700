"""The OpenAI-compatible HTTP server: ``build_app`` wires the routes to an AsyncEngine,
``run_server`` builds the engine from an EngineConfig and serves it with uvicorn.

    from kiln.config import EngineConfig, ModelConfig, ServerConfig
    run_server(EngineConfig(model=ModelConfig("smollm2-135m-instruct"), server=ServerConfig(port=8000)))

Safe by default: binds 127.0.0.1, no CORS unless ``server.cors_origins`` lists origins, no route
that loads files or code named by a request. With ``server.api_key`` (or $KILN_API_KEY) every
``/v1`` route wants ``Authorization: Bearer <key>``; ``/health``, ``/version`` and ``/metrics``
stay open for probes and scrapers. Bodies over ``server.max_request_bytes`` get a 413 before the
app parses them. Stopping uvicorn (SIGINT/SIGTERM) shuts the engine thread down.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import threading
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kiln.config import EngineConfig, ServerConfig
from kiln.version import __version__
from kiln.entrypoints.openai.errors import error_response, install_error_handlers
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from kiln.entrypoints.openai.serving import ServingContext
from kiln.entrypoints.openai.serving_chat import create_chat_completion
from kiln.entrypoints.openai.serving_completions import create_completion
from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.engine import LLMEngine, StartupReport

logger = logging.getLogger(__name__)

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def build_app(engine_client: AsyncEngine, server_config: ServerConfig) -> FastAPI:
    """The FastAPI app for one engine. ``app.state.engine`` is the engine, ``app.state.metrics``
    the server's own Prometheus registry holder."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine_client.shutdown()

    app = FastAPI(title="kiln", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(engine_client.stats, engine_client.is_healthy)
    model_name = server_config.served_model_name or engine_client.model_name or "kiln"
    ctx = ServingContext(engine_client, model_name, metrics)
    app.state.engine = engine_client
    app.state.metrics = metrics
    app.state.serving = ctx
    install_error_handlers(app)

    api_key = server_config.api_key or os.environ.get("KILN_API_KEY") or None
    app.add_middleware(_GuardMiddleware, api_key=api_key, max_request_bytes=server_config.max_request_bytes)
    if server_config.cors_origins:  # added last, so it runs first: preflights carry no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(server_config.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])

    @app.get("/health")
    async def health() -> Response:
        if engine_client.is_ready():
            return JSONResponse({"status": "ok"})
        if engine_client.is_healthy():
            return error_response(503, "the engine is still loading the model", None, "engine_unavailable")
        return error_response(503, f"the engine is not running: {engine_client.error!r}", None, "engine_unavailable")

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=model_name, max_model_len=engine_client.max_model_len)
        return _json(ModelList(data=[card]))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return _json(await create_completion(ctx, body, raw))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return _json(await create_chat_completion(ctx, body, raw))

    return app


def _json(result) -> Response:
    if isinstance(result, Response):
        return result
    return Response(result.model_dump_json(), media_type="application/json")


class _GuardMiddleware:
    """API key and request-size checks, before FastAPI reads or parses anything.

    The body is read here (at most ``max_request_bytes`` of it) and replayed to the app; after
    the replay, ``receive`` is the server's again, so the app still hears a client disconnect.
    """

    def __init__(self, app, api_key: Optional[str], max_request_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._check_headers(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
        body, refusal = await self._read_body(receive)
        if refusal is not None:
            return await refusal(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_headers(self, scope) -> Optional[Response]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope.get("path", "").startswith("/v1"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return error_response(401, "missing or incorrect API key; send Authorization: Bearer <key>",
                                      None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return error_response(400, "Content-Length is not a number", None, "invalid_value")
            if int(length) > self.max_request_bytes:
                return _too_large(self.max_request_bytes)
        return None

    async def _read_body(self, receive) -> tuple[bytes, Optional[Response]]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", None  # the client left; the app will hear it on its own receive
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return b"", _too_large(self.max_request_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _too_large(limit: int) -> Response:
    return error_response(413, f"the request body is larger than the server's limit of {limit} bytes",
                          None, "request_too_large")


def run_server(config: EngineConfig, drain_s: float = 5.0) -> None:
    """Build the engine (blocking until the model is loaded), then serve until SIGINT/SIGTERM.

    On the signal, open requests get ``drain_s`` seconds to finish; then the engine stops, so a
    stream still open ends with an error event and ``[DONE]`` rather than a cut connection.
    """
    server = config.server
    if server.host not in _LOOPBACK_HOSTS and not (server.api_key or os.environ.get("KILN_API_KEY")):
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", server.host)
    reports: list[StartupReport] = []  # the engine thread hands its report over once built

    def make_engine() -> LLMEngine:
        built = LLMEngine(config)
        reports.append(built.startup)
        return built

    engine = AsyncEngine(make_engine, model_name=config.model.model)
    try:
        engine.wait_ready()
        app = build_app(engine, server)
        uv_config = uvicorn.Config(app, host=server.host, port=server.port, log_level="info",
                                   timeout_graceful_shutdown=drain_s + 5.0)
        ready_line = reports[0].ready_line(api_url(server.host, server.port))
        _DrainingServer(uv_config, engine, drain_s, ready_line).run()
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the SIGINT it handled; the server has already stopped cleanly
    finally:
        engine.shutdown()


def api_url(host: str, port: int) -> str:
    """The base URL clients use (``base_url`` of the openai client)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


class _DrainingServer(uvicorn.Server):
    """uvicorn that logs ``ready_line`` once it listens and stops the engine ``drain_s`` after it
    is told to exit."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_s: float, ready_line: str = ""):
        super().__init__(config)
        self._engine = engine
        self._drain_s = drain_s
        self._ready_line = ready_line

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self._ready_line:  # listening: a failed bind ends inside super().startup()
            logger.info(self._ready_line)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            timer = threading.Timer(self._drain_s, self._engine.shutdown)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)
