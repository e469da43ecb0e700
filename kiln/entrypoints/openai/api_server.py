"""The OpenAI-compatible HTTP server (the frontend process): ``build_app`` wires the routes to an
engine client, ``run_server`` starts the engine-core process for an EngineConfig
(``EngineCoreClient``) and serves it with uvicorn.

    from kiln.config import EngineConfig, ModelConfig, ServerConfig
    run_server(EngineConfig(model=ModelConfig("smollm2-135m-instruct"), server=ServerConfig(port=8000)))

Safe by default: binds 127.0.0.1, no CORS unless ``server.cors_origins`` lists origins, no route
that loads files or code named by a request. With an API key (``server.api_key``,
``server.api_key_file`` or $KILN_API_KEY) every ``/v1`` route wants ``Authorization: Bearer <key>``
(the scheme in any case); ``/health``, ``/version`` and ``/metrics`` stay open for probes and
scrapers. A Host header outside ``server.allowed_hosts`` gets a 400 (against DNS rebinding; default
any host), a POST body declared as anything but JSON a 415, and a body over
``server.max_request_bytes`` a 413, all before the app parses anything. Stopping uvicorn
(SIGINT/SIGTERM) drains, then shuts the engine-core process down; if that process dies, every
pending request fails, ``/health`` says 503 and the server exits with status 1, so a supervisor
restarts it. With ``parallel.data_parallel_size=N`` (``DataParallelClient``) a dead replica fails
only its own requests: the others keep serving, ``/health`` says 503 naming it, and the server
exits with status 1 once no replica is left.

With ``server.api_server_count=N`` above 1, this process binds the port, starts the engine core
(``EngineCoreProcess``) and N frontend processes that accept on the one socket, each with its own
``EngineCoreClient``, and then only supervises: SIGINT/SIGTERM goes to every frontend (each drains,
then detaches), and a frontend or an engine core that dies ends the whole server with status 1.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kiln.config import EngineConfig, ServerConfig
from kiln.lora_request import LoRARequest
from kiln.version import __version__
from kiln.entrypoints.openai.errors import error_response, install_error_handlers
from kiln.entrypoints.openai.metrics import MULTIPROCESS_ENV, ServerMetrics
from kiln.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, LoraAdapterRequest, ModelCard,
    ModelList, TokenizeRequest,
)
from kiln.entrypoints.openai.protocol_responses import ResponsesRequest
from kiln.entrypoints.openai.serving import ServingContext
from kiln.entrypoints.openai.serving_chat import create_chat_completion
from kiln.entrypoints.openai.serving_completions import create_completion
from kiln.entrypoints.openai.serving_embeddings import create_embeddings
from kiln.entrypoints.openai.serving_responses import create_response
from kiln.entrypoints.openai.serving_tokens import detokenize, tokenize
from kiln.entrypoints.openai.timeouts import BodyReadTimeoutMiddleware, uvicorn_options
from kiln.engine.core_client import EngineCoreClient
from kiln.engine.launch import LOG_FORMAT, EngineCoreAddress, EngineCoreProcess, inherited_log_level
from kiln.entrypoints.listen import bind_socket
from kiln.engine.dp_client import DataParallelClient
from kiln.engine.streams import EngineClient, QueueLimits

logger = logging.getLogger(__name__)

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def build_app(engine_client: EngineClient, server_config: ServerConfig) -> FastAPI:
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
    ctx = ServingContext(engine_client, model_name, metrics, server_config, loras=lora_modules(server_config))
    lora_routes = LoraRoutes(ctx)
    app.state.engine = engine_client
    app.state.metrics = metrics
    app.state.serving = ctx
    install_error_handlers(app)

    app.add_middleware(_GuardMiddleware, api_key=server_config.resolved_api_key(),
                       max_request_bytes=server_config.max_request_bytes, allowed_hosts=server_config.allowed_hosts)
    # Added after the guard, so it wraps the guard's reading of the body.
    app.add_middleware(BodyReadTimeoutMiddleware, timeout_s=server_config.body_read_timeout_s)
    if server_config.cors_origins:  # added last, so it runs first: preflights carry no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(server_config.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])

    @app.get("/health")
    async def health() -> Response:
        degraded = getattr(engine_client, "degraded", lambda: None)()  # data parallel: a replica stopped
        if degraded is not None:
            return error_response(503, degraded, None, "engine_unavailable")
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
        adapters = [ModelCard(id=name, root=lora.lora_path, parent=model_name, max_model_len=engine_client.max_model_len)
                    for name, lora in ctx.loras.items()]
        return _json(ModelList(data=[card, *adapters]))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoraAdapterRequest) -> Response:
        return await lora_routes.load(body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: LoraAdapterRequest) -> Response:
        return await lora_routes.unload(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return _json(await create_completion(ctx, body, raw))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return _json(await create_chat_completion(ctx, body, raw))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return _json(await create_response(ctx, body, raw))

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        return _json(await create_embeddings(ctx, body, raw))

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> Response:
        return _json(tokenize(ctx, body))

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        return _json(detokenize(ctx, body))

    return app


def lora_modules(server: ServerConfig) -> dict[str, LoRARequest]:
    """``server.lora_modules`` ("name=path" each) as adapters, ids from 1 in order."""
    loras = {}
    for i, entry in enumerate(server.lora_modules):
        name, path = entry.split("=", 1)
        loras[name] = LoRARequest(name, i + 1, path)
    return loras


class LoraRoutes:
    """Adapters loaded and unloaded at run time: the engine reads and checks one before its name
    is served (a bad one is a 400 naming the file and field); every load takes a fresh id, so a
    reloaded adapter never hits blocks cached under the old one."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self._next_id = len(ctx.loras) + 1

    async def load(self, body: LoraAdapterRequest) -> Response:
        if not body.lora_path:
            return error_response(400, "lora_path is required: a PEFT adapter directory", "lora_path")
        if body.lora_name in self.ctx.loras or body.lora_name == self.ctx.model_name:
            return error_response(400, f"the model name `{body.lora_name}` is in use; unload it first",
                                  "lora_name")
        add = getattr(self.ctx.engine, "add_lora", None)
        if add is None:
            return error_response(400, "this engine serves no LoRA adapters", "lora_name")
        lora = LoRARequest(body.lora_name, self._next_id, body.lora_path)
        self._next_id += 1
        try:
            await add(lora)
        except ValueError as e:
            return error_response(400, str(e), "lora_path")
        self.ctx.loras[lora.lora_name] = lora
        return Response(f"LoRA adapter {lora.lora_name} loaded", media_type="text/plain")

    async def unload(self, body: LoraAdapterRequest) -> Response:
        lora = self.ctx.loras.pop(body.lora_name, None)
        if lora is None:
            return error_response(404, f"the LoRA adapter `{body.lora_name}` is not loaded", "lora_name",
                                  "model_not_found")
        await self.ctx.engine.remove_lora(lora.lora_int_id)
        return Response(f"LoRA adapter {lora.lora_name} unloaded", media_type="text/plain")


def _json(result) -> Response:
    if isinstance(result, Response):
        return result
    return Response(result.model_dump_json(), media_type="application/json")


class _GuardMiddleware:
    """Host, API key, content-type and request-size checks, before FastAPI reads or parses anything.

    The body is read here (at most ``max_request_bytes`` of it) and replayed to the app; after
    the replay, ``receive`` is the server's again, so the app still hears a client disconnect.
    """

    def __init__(self, app, api_key: Optional[str], max_request_bytes: int, allowed_hosts: tuple[str, ...] = ("*",)):
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.allowed_hosts = None if "*" in allowed_hosts else tuple(h.lower() for h in allowed_hosts)

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
        if self.allowed_hosts is not None and not _host_allowed(headers.get("host", ""), self.allowed_hosts):
            return error_response(400, "the Host header names a host this server does not serve "
                                       "(server.allowed_hosts)", None, "invalid_host")
        if self.api_key and scope.get("path", "").startswith("/v1") and not self._authorized(headers):
            return error_response(401, "missing or incorrect API key; send Authorization: Bearer <key>",
                                  None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        content_type = headers.get("content-type")
        if scope.get("method") == "POST" and content_type is not None and not _is_json(content_type):
            return error_response(415, f"the request body must be JSON; send Content-Type: application/json "
                                       f"(got {content_type[:80]!r})", None, "unsupported_media_type")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return error_response(400, "Content-Length is not a number", None, "invalid_value")
            if int(length) > self.max_request_bytes:
                return _too_large(self.max_request_bytes)
        return None

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        # The scheme is case-insensitive (RFC 9110); compare_digest keeps the key's timing private.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

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


def _host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Starlette's TrustedHostMiddleware rule: the Host header's name (port dropped) equals an
    entry, or ends with what follows an entry's leading ``*``."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host  # [::1]:8000 -> [::1]
    name = name.lower()
    return any(name == h or (h.startswith("*") and name.endswith(h[1:])) for h in allowed)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _too_large(limit: int) -> Response:
    return error_response(413, f"the request body is larger than the server's limit of {limit} bytes",
                          None, "request_too_large")


def run_server(config: EngineConfig, drain_s: float = 5.0, engine_core: Optional[EngineCoreProcess] = None,
               sock: Optional[socket.socket] = None) -> None:
    """Build the engine (blocking until the model is loaded), then serve until SIGINT/SIGTERM.

    ``kiln serve`` binds ``sock`` and spawns ``engine_core`` (with ``server.api_server_count``
    socket pairs) before it imports this module; without them, both happen here. On the signal,
    open requests get ``drain_s`` seconds to finish; then the engine stops, so a stream still open
    ends with an error event and ``[DONE]`` rather than a cut connection.
    """
    server = config.server
    try:
        if sock is None:  # before a start that may take minutes: a bad port fails at once
            sock = bind_socket(server.host, server.port)
        if server.host not in _LOOPBACK_HOSTS and not server.resolved_api_key():
            logger.warning("serving on %s without an API key: anyone who can reach it can use it", server.host)
        with contextlib.closing(sock):
            if server.api_server_count == 1:
                _serve(config, sock, drain_s, started=engine_core)
            else:
                _supervise(config, sock, drain_s, engine_core)
    finally:
        if engine_core is not None:  # gone by now, unless the server failed before its client took it
            engine_core.stop(timeout=0)


def _serve(config: EngineConfig, sock: socket.socket, drain_s: float,
           shared: Optional[EngineCoreAddress] = None, started: Optional[EngineCoreProcess] = None) -> None:
    """One frontend: its engine client (its own engine core, ``started`` or a new one, or
    ``shared``'s), the app, uvicorn."""
    server = config.server
    died = threading.Event()
    uv_server: list[uvicorn.Server] = []

    def on_dead() -> None:  # the reader thread: stop serving, then exit non-zero
        died.set()
        if uv_server:
            uv_server[0].should_exit = True

    if config.parallel.data_parallel_size > 1:
        engine = DataParallelClient(config, model_name=config.model.model, limits=QueueLimits.from_server(server),
                                    on_dead=on_dead)
    else:
        engine = EngineCoreClient(config, model_name=config.model.model, limits=QueueLimits.from_server(server),
                                  on_dead=on_dead, shared=shared, started=started)
    try:
        engine.wait_ready()
        app = build_app(engine, server)
        uv_config = uvicorn.Config(app, host=server.host, port=server.port, log_level="info",
                                   timeout_graceful_shutdown=drain_s + 5.0, **uvicorn_options(server))
        ready_line = ""
        if shared is None or shared.index == 0:
            ready_line = engine.startup.ready_line(api_url(server.host, server.port))
            if shared is not None:
                ready_line += f"; {server.api_server_count} frontend processes"
            if config.parallel.data_parallel_size > 1:
                ready_line += f"; {config.parallel.data_parallel_size} data-parallel replicas"
        uv_server.append(_DrainingServer(uv_config, engine, drain_s, ready_line))
        if not died.is_set():
            uv_server[0].run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the SIGINT it handled; the server has already stopped cleanly
    finally:
        engine.shutdown()
    if died.is_set():
        logger.error("the engine core died (%s); exiting with status 1", engine.error)
        raise SystemExit(1)


def _supervise(config: EngineConfig, sock: socket.socket, drain_s: float,
               engine: Optional[EngineCoreProcess] = None) -> None:
    """``server.api_server_count`` frontend processes over one engine core (``engine``, or one
    spawned here), until a signal or a death."""
    count = config.server.api_server_count
    ctx = multiprocessing.get_context("spawn")
    start_errors = ctx.SimpleQueue()
    metrics_dir = tempfile.mkdtemp(prefix="kiln-metrics-")
    log_level = inherited_log_level()
    engine = engine or EngineCoreProcess(config, count)
    frontends: list[multiprocessing.Process] = []
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            for p in frontends:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)  # each drains, then detaches from the engine core

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed = False
    try:
        previous = os.environ.get(MULTIPROCESS_ENV)
        os.environ[MULTIPROCESS_ENV] = metrics_dir  # the frontends inherit it: one set of metric files
        try:
            for i in range(count):
                frontends.append(ctx.Process(target=_frontend_main, name=f"kiln-frontend-{i}",
                                             args=(config, sock, engine.address(i), drain_s, log_level, start_errors)))
                frontends[-1].start()
        finally:
            if previous is None:
                del os.environ[MULTIPROCESS_ENV]
            else:
                os.environ[MULTIPROCESS_ENV] = previous
        running = {p.sentinel: p for p in frontends}
        watched = [*running, engine.process.sentinel]
        while running:
            for sentinel in multiprocessing.connection.wait(watched):
                watched.remove(sentinel)
                if sentinel == engine.process.sentinel:
                    engine.process.join()
                    # Status 0: it did not start (the frontends report why) or it was told to stop.
                    if engine.process.exitcode != 0 and not stopping:  # the frontends exit 1 too
                        failed = True
                        logger.error("the engine core died (exit code %s)", engine.process.exitcode)
                    continue
                p = running.pop(sentinel)
                p.join()  # its sentinel can fire before it is reaped
                if p.exitcode != 0 and not stopping:
                    logger.error("frontend process %s exited with %s; stopping the server", p.name, p.exitcode)
                    stop()
                failed = failed or p.exitcode != 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        stop()
        for p in frontends:
            p.join(drain_s + 15.0)
            if p.is_alive():
                p.kill()
        # A frontend that died never detached, so the engine core would wait for it: not long, then.
        engine.stop(timeout=2.0 if failed else 30.0)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if not start_errors.empty():
        error_type, message = start_errors.get()
        raise ValueError(message) if error_type == "ValueError" else RuntimeError(message)
    if failed:
        raise SystemExit(1)


def _frontend_main(config: EngineConfig, sock: socket.socket, shared: EngineCoreAddress, drain_s: float,
                   log_level: Optional[int], start_errors) -> None:
    """A frontend process of ``_supervise``: serve on the shared socket until SIGTERM."""
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor alone, which passes it on once

    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    # uvicorn drains on SIGTERM, then raises it again: here that ends _serve, which detaches.
    signal.signal(signal.SIGTERM, interrupt)
    if log_level is not None:
        logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        _serve(config, sock, drain_s, shared)
    except (ValueError, RuntimeError) as e:  # the engine did not start: the supervisor reports it once
        if shared.index == 0:
            start_errors.put((type(e).__name__, str(e)))
        raise SystemExit(2) from None


def api_url(host: str, port: int) -> str:
    """The base URL clients use (``base_url`` of the openai client)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


class _DrainingServer(uvicorn.Server):
    """uvicorn that logs ``ready_line`` once it listens and stops the engine ``drain_s`` after it
    is told to exit."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, drain_s: float, ready_line: str = ""):
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
