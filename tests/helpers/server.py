"""A real server for the tests that drive kiln's HTTP API: uvicorn on a free localhost port in a
thread (``ServerThread``), over an engine-core process as ``kiln serve`` runs one (``serve``,
``engine_core``), or over a stand-in engine that can be made to fail on demand (``FakeEngine``);
and the checks of what it answers (``assert_error``, ``metric``, ``idle_free_blocks``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kiln.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, ServerConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.core_client import EngineCoreClient
from kiln.engine.streams import QueueLimits
from kiln.entrypoints.openai import build_app
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams

TINY = "random:tiny"
SMOL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 1024
NUM_BLOCKS = 1024
CHAT = [{"role": "user", "content": "Name a colour."}]


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 (a port the OS picks) from a background thread."""

    def __init__(self, app, **options):
        """``options``: more ``uvicorn.Config`` arguments (``timeouts.uvicorn_options``)."""
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.app = app
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def engine_core(model: str, quantization: str = "auto", **server) -> EngineCoreClient:
    """An engine-core process, as ``kiln serve`` runs one, once ready (``quantization``: the
    model's; ``none`` for answers compared with transformers on the dequantized weights); apps
    over it are ``ServerThread(build_app(engine, ServerConfig(...)))``. Eager, as the suite's
    in-process engines on the CPU (``cpu_auto_is_eager``, which a spawned process does not
    inherit): the CPU default would compile the model on a thread beside every server's requests."""
    config = EngineConfig(
        model=ModelConfig(model, max_model_len=MAX_MODEL_LEN, quantization=quantization),
        cache=CacheConfig(num_blocks=NUM_BLOCKS),
        compile=CompileConfig(mode="eager"),
        server=ServerConfig(**server),
    )
    engine = EngineCoreClient(config, limits=QueueLimits.from_server(config.server))
    engine.wait_ready(timeout=300)
    return engine


def serve(model: str, quantization: str = "auto", **server) -> tuple[ServerThread, EngineCoreClient]:
    """A server over a new ``engine_core(model, quantization, **server)``."""
    engine = engine_core(model, quantization, **server)
    return ServerThread(build_app(engine, ServerConfig(**server))), engine


def idle_free_blocks(engine: AsyncEngine) -> int:
    """The engine's free blocks once it is idle, which must be all but the null block."""
    deadline = time.monotonic() + 10
    while engine.stats()["num_running"] or engine.stats()["num_waiting"]:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1  # all free but block 0, the pool's null block
    return stats["num_free_blocks"]


def metric(url: str, name: str, labels: dict | None = None) -> float:
    """The value of the sample ``name`` (with ``labels``) on ``url``'s /metrics; 0.0 when absent."""
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or all(sample.labels.get(k) == v for k, v in labels.items())):
                return sample.value
    return 0.0


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """``r`` is an OpenAI-shaped error of ``status`` (naming ``param`` if given); its error object."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


class FakeEngine:
    """Stands in for LLMEngine: one token ("x", id 7) per request per step, forever until
    max_tokens; ``step`` raises once ``fail`` is set."""

    tokenizer = None
    max_model_len = 1 << 20

    def __init__(self, fail: threading.Event):
        self.fail = fail
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.num_polls = 0
        self.shut_down = False

    def add_request(self, request_id, prompt, params, priority=0, add_special_tokens=True):
        self.requests[request_id] = ([1] * len(prompt), params, [])

    def step(self) -> list[RequestOutput]:
        if self.fail.is_set():
            raise RuntimeError("injected fault")
        time.sleep(0.01)
        outs = []
        for rid, (prompt_ids, params, tokens) in list(self.requests.items()):
            tokens.append(7)
            done = len(tokens) >= params.max_tokens
            outs.append(self._output(rid, "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def _output(self, rid: str, finish: str | None) -> RequestOutput:
        prompt_ids, _, tokens = self.requests[rid]
        sample = CompletionOutput(0, "x" * len(tokens), list(tokens), finish)
        return RequestOutput(rid, None, prompt_ids, [sample], finished=finish is not None)

    def abort_request(self, rid):
        out = self._output(rid, "abort") if rid in self.requests else None
        self.requests.pop(rid, None)
        return out

    def has_unfinished_requests(self) -> bool:
        self.num_polls += 1
        return bool(self.requests)

    def stats(self) -> dict:
        return {"num_running": len(self.requests), "num_waiting": 0, "num_free_blocks": 9, "num_blocks": 10,
                "prefix_cache_hit_rate": 0.0}

    def shutdown(self) -> None:
        self.shut_down = True


def start_server_process(port: int, model: str, num_blocks: int, parallel: str = "", **server) -> subprocess.Popen:
    """``run_server`` on ``model`` (eager, ``num_blocks`` KV blocks) in a child process, once healthy;
    ``parallel`` is ParallelConfig keywords as source text. ``server_log(proc)`` reads its stderr."""
    from kiln.bench.serve import wait_healthy

    code = ("from kiln.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, ParallelConfig, "
            "ServerConfig\n"
            "from kiln.entrypoints.openai import run_server\n"
            f"run_server(EngineConfig(model=ModelConfig({model!r}), cache=CacheConfig(num_blocks={num_blocks}), "
            f"compile=CompileConfig(mode='eager'), parallel=ParallelConfig({parallel}), "
            f"server=ServerConfig(port={port}, **{server!r})))\n")
    log = tempfile.TemporaryFile("w+")  # not a pipe, which a chatty server could fill
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    wait_healthy(f"http://127.0.0.1:{port}", proc, 300)
    return proc


def server_log(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read()
