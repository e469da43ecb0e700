"""No single request can stop the server: hostile requests against a real uvicorn server.

Each case sends one bad request (a seed out of range, text that is no Unicode, too many prompts x n,
a full queue, a kiln bug, a client that stops sending) and checks the answer: its status and
OpenAI's error schema. Then it checks that the server still serves: a greedy request gives the
same tokens as before any bad one, /health is 200, every KV block is free again and nothing is
left counted against the queue limits. The server runs ``random:tiny`` with tiny limits and
1 s deadlines, so each case takes a few seconds at most.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading
import time
from typing import Union
from dataclasses import dataclass

import httpx
import pytest

from kiln.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from kiln.entrypoints.openai import build_app
from kiln.entrypoints.openai.errors import APIError
from kiln.entrypoints.openai.serving import ServingContext
from kiln.entrypoints.openai.timeouts import uvicorn_options
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.core_client import EngineCoreClient
from kiln.engine.streams import QueueLimits
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.input_processor import InputProcessor
from kiln.runtime.scheduler import Scheduler
from kiln.sampling_params import SamplingParams
from tests.helpers.server import (
    CHAT, MAX_MODEL_LEN, NUM_BLOCKS, TINY, FakeEngine, ServerThread, assert_error, idle_free_blocks,
)

TIMEOUT_S = 1.0
LIMITS = dict(max_prompts_per_request=8, max_seqs_per_request=16, max_queued_seqs=8, max_queued_tokens=2048,
              header_read_timeout_s=TIMEOUT_S, body_read_timeout_s=TIMEOUT_S, keep_alive_timeout_s=TIMEOUT_S)
PROBE = {"model": TINY, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
# Runs until closed: 1,000 tokens take seconds here, far longer than a test holds it.
HELD = {"prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True, "stop": ["HOLD"]}
REQUEST_ID = re.compile(r"request ((?:chat)?cmpl-[0-9a-f]{32}|resp-[0-9a-f]{32})")


@dataclass
class Served:
    server: ServerThread
    engine: Union[EngineCoreClient, AsyncEngine]
    baseline: list[int]  # PROBE's tokens before any bad request

    @property
    def url(self) -> str:
        return self.server.url


def _start(in_process: bool) -> Served:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KILN_API_KEY", raising=False)
        config = EngineConfig(model=ModelConfig(TINY, max_model_len=MAX_MODEL_LEN),
                              cache=CacheConfig(num_blocks=NUM_BLOCKS), server=ServerConfig(**LIMITS))
        engine = (AsyncEngine.from_config(config) if in_process
                  else EngineCoreClient(config, limits=QueueLimits.from_server(config.server)))
        engine.wait_ready(timeout=300)
        server = ServerThread(build_app(engine, config.server), **uvicorn_options(config.server))
    return Served(server, engine, _probe(server.url))


@pytest.fixture(scope="module")
def served():
    """The server over an engine-core process, as ``kiln serve`` runs it."""
    s = _start(in_process=False)
    yield s
    s.server.stop()


@pytest.fixture(scope="module")
def served_here():
    """The same over an engine on a thread of this process, where a test can inject a bug into it
    (a monkeypatch does not reach another process) and read its log."""
    s = _start(in_process=True)
    yield s
    s.server.stop()


def _probe(url: str) -> list[int]:
    r = httpx.post(url + "/v1/completions", json=PROBE, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _assert_still_serving(s: Served) -> None:
    """Nothing counted as queued once idle (an abort lands on the engine's next turn), every block
    free, healthy, and the same greedy tokens as before; then idle and free again."""
    deadline = time.monotonic() + 5
    while s.engine.stats()["num_queued_seqs"] or s.engine.stats()["num_queued_tokens"]:
        assert time.monotonic() < deadline, f"queue limits still held: {s.engine.stats()}"
        time.sleep(0.01)
    idle_free_blocks(s.engine)
    assert httpx.get(s.url + "/health").status_code == 200
    assert _probe(s.url) == s.baseline
    idle_free_blocks(s.engine)


def _post_raw(url: str, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800; httpx's json= would fail to encode it.
    return httpx.post(url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                      timeout=30)


# ---- bad input: 400, and the engine goes on ------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_seed_out_of_range_is_400(served, path, seed):
    body = {"model": TINY, "prompt": "hi", "messages": CHAT, "max_tokens": 4, "temperature": 1.0, "seed": seed}
    error = assert_error(httpx.post(served.url + path, json=body), 400, "seed")
    assert "seed" in error["message"]
    _assert_still_serving(served)


@pytest.mark.parametrize("seed,n", [(-1, 1), (2**63 - 1, 2), (-(2**63), 1)])
def test_seeds_at_the_edges_run_and_repeat(served, seed, n):
    body = {"model": TINY, "prompt": "hi", "max_tokens": 6, "temperature": 1.0, "seed": seed, "n": n,
            "return_token_ids": True}
    runs = [httpx.post(served.url + "/v1/completions", json=body, timeout=30) for _ in range(2)]
    assert [r.status_code for r in runs] == [200, 200], runs[0].text
    tokens = [sorted((c["index"], c["token_ids"]) for c in r.json()["choices"]) for r in runs]
    assert tokens[0] == tokens[1] and len(tokens[0]) == n  # seeded: reproducible
    _assert_still_serving(served)


@pytest.mark.parametrize("prompt", ["abc\ud800", ["fine", "abc\udfff def"]])
def test_lone_surrogate_in_prompt_is_400(served, prompt):
    r = _post_raw(served.url, "/v1/completions", {"model": TINY, "prompt": prompt, "max_tokens": 4})
    error = assert_error(r, 400, "prompt")
    assert "surrogate" in error["message"] or "unicode" in error["message"].lower()
    _assert_still_serving(served)


def test_lone_surrogate_in_chat_is_400(served):
    messages = [{"role": "user", "content": "Name a colour \ud800."}]
    r = _post_raw(served.url, "/v1/chat/completions", {"model": TINY, "messages": messages, "max_tokens": 4})
    error = assert_error(r, 400)
    assert error["param"].startswith("messages")
    assert "surrogate" in error["message"] or "unicode" in error["message"].lower()
    _assert_still_serving(served)


def test_tokenizer_type_error_is_bad_input():
    class Refusing:
        def encode(self, text, add_special_tokens=True):
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")

    inputs = InputProcessor(Refusing(), vocab_size=100, max_model_len=64)
    with pytest.raises(ValueError, match="^prompt could not be tokenized"):
        inputs.process("fine text", SamplingParams())
    with pytest.raises(ValueError, match="^prompt is not valid Unicode text"):
        inputs.process("abc\ud800", SamplingParams())
    params = SamplingParams(seed=7)
    params.seed = 2**64  # SamplingParams is mutable: the engine checks again
    with pytest.raises(ValueError, match="^seed must be"):
        inputs.process([1, 2], params)


# ---- limits: 400 for what never fits, 429 while the queue is full -------------------------------
OVER_LIMITS = [
    ({"prompt": ["hi"] * 50, "n": 64}, "prompt", "server.max_prompts_per_request=8"),
    ({"prompt": ["hi"] * 4, "n": 5}, "n", "server.max_seqs_per_request=16"),
    ({"prompt": ["hi"] * 2, "n": 6}, "prompt", "server.max_queued_seqs=8"),  # 12 sequences: never fits the queue
    ({"prompt": [[100] * 600], "n": 4}, "prompt", "server.max_queued_tokens=2048"),  # 2400 prompt tokens
]


@pytest.mark.parametrize("body,param,limit", OVER_LIMITS)
def test_request_over_a_limit_is_400(served, body, param, limit):
    r = httpx.post(served.url + "/v1/completions", json={"model": TINY, "max_tokens": 2, **body})
    error = assert_error(r, 400, param)
    assert limit in error["message"] and error["code"] == "limit_exceeded"
    _assert_still_serving(served)


def test_default_limits_refuse_the_50_prompts_x_64_body():
    ctx = ServingContext(engine=None, model_name=TINY, metrics=None)  # ServerConfig's defaults
    with pytest.raises(APIError) as refused:
        ctx._check_size(50, 64)
    assert refused.value.status == 400 and "server.max_seqs_per_request=1024" in refused.value.message


QUEUE_FULL = [
    ({**HELD, "n": 8}, {"prompt": "hi"}, "server busy: 8 sequences queued (server.max_queued_seqs=8)"),
    ({**HELD, "prompt": [100] * 300, "n": 4, "max_tokens": 700}, {"prompt": [100] * 300, "n": 3},
     "server busy: 1200 prompt tokens queued (server.max_queued_tokens=2048)"),
]


@pytest.mark.parametrize("held,extra,message", QUEUE_FULL)
def test_full_queue_is_429(served, held, extra, message):
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", served.url + "/v1/completions", json={"model": TINY, **held}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator would close the stream
            next(line for line in lines if line.startswith("data: "))  # running now
            busy = httpx.post(served.url + "/v1/completions", json={"model": TINY, "max_tokens": 2, **extra})
            error = assert_error(busy, 429)
            assert error["message"].startswith(message) and error["code"] == "server_busy"
            assert error["type"] == "rate_limit_error" and busy.headers["retry-after"] == "1"
    _assert_still_serving(served)  # closing the stream aborted it and gave its share back


# ---- a kiln bug fails its own request only: 500 naming it ----------------------------------------
def _inject_bug(monkeypatch, where: str) -> None:
    """Make every request with the stop string "BOOM" hit a RuntimeError on the engine thread:
    while being added (its second sample, after the first was queued) or in detokenization."""
    if where == "add":
        original = Scheduler.add_request

        def add_request(self, request):
            if "BOOM" in request.sampling_params.stop and request.request_id.endswith("#1"):
                raise RuntimeError("injected kiln bug")
            return original(self, request)

        monkeypatch.setattr(Scheduler, "add_request", add_request)
    else:
        original = IncrementalDetokenizer.add

        def add(self, token_id):
            if "BOOM" in self.stop_strings:
                raise RuntimeError("injected kiln bug")
            return original(self, token_id)

        monkeypatch.setattr(IncrementalDetokenizer, "add", add)


@pytest.mark.parametrize("where", ["add", "output"])
def test_kiln_bug_is_500_with_request_id(served_here, monkeypatch, caplog, where):
    _inject_bug(monkeypatch, where)
    bad = {"model": TINY, "prompt": "hello there", "max_tokens": 16, "n": 2, "stop": ["BOOM"]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(_probe, served_here.url)  # runs beside the failing request, unharmed
        error = assert_error(httpx.post(served_here.url + "/v1/completions", json=bad, timeout=30), 500)
        assert good.result() == served_here.baseline
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    request_id = REQUEST_ID.search(error["message"]).group(1)
    logged = [r for r in caplog.records if request_id in r.getMessage() and r.exc_info]
    assert logged and "injected kiln bug" in str(logged[0].exc_info[1])
    _assert_still_serving(served_here)


def test_kiln_bug_mid_stream_is_an_error_event(served_here, monkeypatch):
    _inject_bug(monkeypatch, "output")
    body = {"model": TINY, "messages": CHAT, "max_tokens": 16, "stop": ["BOOM"], "stream": True}
    with httpx.stream("POST", served_here.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "internal_error" and REQUEST_ID.search(error["message"])
    _assert_still_serving(served_here)


# ---- the Responses API: the same guarantees ------------------------------------------------------
RESPONSES_BAD = [
    ({"input": "hi", "seed": 2**64}, "seed"),
    ({"input": "abc\ud800"}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "\udfff"}]}]},
     "input"),
    ({"input": [{"role": "user", "content": "hi"}] * 3, "max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}],
      "tool_choice": "required"}, "tools"),
]


@pytest.mark.parametrize("body,param", RESPONSES_BAD)
def test_bad_responses_requests_are_400(served, body, param):
    assert_error(_post_raw(served.url, "/v1/responses", {"model": TINY, "max_output_tokens": 4, **body}), 400, param)
    _assert_still_serving(served)


def test_full_queue_is_429_for_responses(served):
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", served.url + "/v1/completions", json={"model": TINY, **HELD, "n": 8}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(served.url + "/v1/responses", json={"model": TINY, "input": "hi", "max_output_tokens": 2})
            assert assert_error(busy, 429)["code"] == "server_busy"
    _assert_still_serving(served)


def test_kiln_bug_mid_response_stream_is_an_error_event(served_here, monkeypatch):
    _inject_bug(monkeypatch, "output")
    body = {"model": TINY, "input": "hi", "max_output_tokens": 16, "stop": ["BOOM"], "stream": True}
    with httpx.stream("POST", served_here.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["code"] == "internal_error" and REQUEST_ID.search(events[-1]["message"])
    assert events[-1]["sequence_number"] == 2
    _assert_still_serving(served_here)


def test_kiln_bug_in_a_response_is_500(served_here, monkeypatch):
    _inject_bug(monkeypatch, "output")
    body = {"model": TINY, "input": "hi", "max_output_tokens": 16, "stop": ["BOOM"]}
    error = assert_error(httpx.post(served_here.url + "/v1/responses", json=body, timeout=30), 500)
    assert error["code"] == "internal_error" and REQUEST_ID.search(error["message"])
    _assert_still_serving(served_here)


# ---- slow clients: deadlines on headers and body -------------------------------------------------
def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(10 * TIMEOUT_S)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def test_half_sent_body_is_408_and_closed(served):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")
    with _connect(served.url) as sock:
        sock.sendall(head + b'{"prompt": "hel')  # 15 of the 200 bytes promised
        data, elapsed = _read_until_closed(sock)
    assert TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S + 2
    status, _, body = data.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_timeout"
    assert "server.body_read_timeout_s" in error["message"]
    _assert_still_serving(served)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\n"])
def test_half_sent_headers_are_closed(served, sent):
    with _connect(served.url) as sock:
        sock.sendall(sent)
        data, elapsed = _read_until_closed(sock)
    assert data == b"" and TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S + 2
    _assert_still_serving(served)


def test_keep_alive_connection_gets_a_header_deadline_per_request(served):
    body = json.dumps({**PROBE, "return_token_ids": False}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with _connect(served.url) as sock:
        sock.sendall(request)
        first = b""
        while not (first.count(b"\r\n\r\n") and first.endswith(b"}")):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT_S / 2)  # within keep-alive, then half a second request
        sock.sendall(request[:20])
        data, elapsed = _read_until_closed(sock)
    assert data == b"" and TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S + 2


def test_slow_but_timely_body_is_served(served):
    body = json.dumps(PROBE).encode()

    def parts():
        yield body[:10]
        time.sleep(TIMEOUT_S / 3)
        yield body[10:]

    r = httpx.post(served.url + "/v1/completions", content=parts(), headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == served.baseline


# ---- the engine stops: every pending request still gets an answer --------------------------------
def test_engine_shutdown_answers_pending_requests_with_503(monkeypatch):
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    fake = FakeEngine(threading.Event())
    engine = AsyncEngine(lambda: fake, model_name="fake")
    server = ServerThread(build_app(engine, ServerConfig()))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, server.url + "/v1/completions",
                                  json={"prompt": "hi", "max_tokens": 10**9}, timeout=30)
            deadline = time.monotonic() + 10
            while not fake.requests:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            engine.shutdown()
            error = assert_error(pending.result(), 503)
        assert error["code"] == "engine_unavailable" and "shut down" in error["message"]
        assert assert_error(httpx.get(server.url + "/health"), 503)["code"] == "engine_unavailable"
    finally:
        server.stop()
