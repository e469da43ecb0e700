"""The OpenAI-compatible server end to end: a real uvicorn server on a free localhost port, driven
with the official openai client (httpx for raw cases) and checked against the LLM API.

Most tests use ``random:tiny``; a few use the real ``smollm2-135m-instruct``. A stand-in engine
(FakeEngine, in ``tests/helpers/server.py``) covers what a real model cannot stage on demand:
loading, crashing, shutting down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import prometheus_client
import pytest

from kiln import LLM, SamplingParams
from kiln.config import ServerConfig
from kiln.entrypoints.openai import build_app
from kiln.outputs import CompletionOutput
from kiln.engine.async_engine import AsyncEngine, EngineDeadError
from tests.helpers.paths import REPO
from tests.helpers.server import (
    CHAT, MAX_MODEL_LEN, NUM_BLOCKS, SMOL, TINY, FakeEngine, ServerThread, assert_error, idle_free_blocks, metric, serve,
)

MAX_REQUEST_BYTES = 64 * 1024


def _llm(model: str) -> LLM:
    return LLM(model, max_model_len=MAX_MODEL_LEN, cache={"num_blocks": NUM_BLOCKS})


def _greedy(llm: LLM, prompts, max_tokens: int, **kw) -> list[CompletionOutput]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KILN_API_KEY", raising=False)
        server, engine = serve(TINY, max_request_bytes=MAX_REQUEST_BYTES)
    yield server
    server.stop()
    assert not engine.is_healthy()  # stopping uvicorn shut the engine thread down


@pytest.fixture(scope="module")
def tiny_llm():
    return _llm(TINY)


@pytest.fixture(scope="module")
def client(tiny):
    return tiny.client()


def _wait_free(engine: AsyncEngine, free: int, within_s: float) -> float:
    """Seconds until the engine holds no blocks (``free`` free again); fails after ``within_s``."""
    start = time.monotonic()
    while engine.stats()["num_free_blocks"] != free or engine.stats()["num_running"]:
        assert time.monotonic() - start < within_s, f"blocks still held: {engine.stats()}"
        time.sleep(0.01)
    return time.monotonic() - start


# ---- endpoints -----------------------------------------------------------------------------------
def test_models_health_version(tiny, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [TINY]
    assert httpx.get(tiny.url + "/health").status_code == 200
    assert httpx.get(tiny.url + "/version").json()["version"]
    assert_error(httpx.get(tiny.url + "/v1/nothing-here"), 404)


def test_completions_match_llm(client, tiny_llm):
    token_prompt = tiny_llm.tokenizer.encode("1, 2, 3, 4,")
    prompts = ["The capital of France is", "Once upon a time", token_prompt]
    expected = _greedy(tiny_llm, prompts, 12)
    r = client.completions.create(model=TINY, prompt=prompts[:2], max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    r_ids = client.completions.create(model=TINY, prompt=token_prompt, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    choices = sorted(r.choices, key=lambda c: c.index) + r_ids.choices
    for choice, want in zip(choices, expected):
        assert choice.token_ids == want.token_ids
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r_ids.usage.prompt_tokens == len(token_prompt)


def test_completions_stream_matches_non_stream(client):
    kwargs = dict(model=TINY, prompt="Once upon a time", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_n_and_seed(client):
    kwargs = dict(model=TINY, prompt="hello world", max_tokens=6, temperature=1.0, n=3, seed=7,
                  extra_body={"return_token_ids": True})
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == sum(len(c.token_ids) for c in a.choices)
    stream = client.completions.create(stream=True, **{**kwargs, "prompt": ["hello world", "hi"]})
    seen = {c.index for chunk in stream for c in chunk.choices}
    assert seen == set(range(6))  # choice = prompt * n + sample
    # Samples that stop at different steps: each choice still ends exactly once.
    staggered = {**kwargs, "max_tokens": 16, "stop": ["o"]}
    assert len({len(c.token_ids) for c in client.completions.create(**staggered).choices}) > 1
    stream = client.completions.create(stream=True, **staggered)
    assert sorted(c.index for chunk in stream for c in chunk.choices if c.finish_reason) == [0, 1, 2]


def test_completions_logprobs_and_echo(client, tiny_llm):
    prompt = "The capital of France is"
    r = client.completions.create(model=TINY, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    echoed = client.completions.create(model=TINY, prompt=prompt, max_tokens=5, temperature=0, logprobs=1, echo=True)
    choice = echoed.choices[0]
    num_prompt = len(tiny_llm.tokenizer.encode(prompt))
    assert choice.text == prompt + r.choices[0].text
    head = choice.logprobs.token_logprobs[:num_prompt]  # the prompt is scored, but nothing predicts its first token
    assert head[0] is None and all(lp <= 0 for lp in head[1:])
    assert choice.logprobs.token_logprobs[num_prompt:] == pytest.approx(lp.token_logprobs)
    assert choice.logprobs.text_offset[num_prompt] == len(prompt)
    chunks = list(client.completions.create(model=TINY, prompt=prompt, max_tokens=5, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == choice.text
    assert [t for p in parts if p.logprobs for t in p.logprobs.tokens] == choice.logprobs.tokens
    assert [o for p in parts if p.logprobs for o in p.logprobs.text_offset] == choice.logprobs.text_offset


def test_completions_stop(client, tiny_llm):
    prompt = "Once upon a time"
    full = _greedy(tiny_llm, [prompt], 12)[0].text
    stop = " Mu"  # a string that ends inside a generated token (" Musk")
    assert stop in full
    for stream in (False, True):
        r = client.completions.create(model=TINY, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                      stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full[: full.index(stop)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_continued_chat_matches_llm(client, tiny_llm):
    """continue_final_message: the server and LLM.chat continue the last message alike."""
    messages = CHAT + [{"role": "assistant", "content": "Blue is"}]
    want = tiny_llm.chat(messages, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False,
                         add_generation_prompt=False, continue_final_message=True,
                         chat_template_kwargs={"unused": True})[0].outputs[0]
    r = client.chat.completions.create(model=TINY, messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True, "continue_final_message": True})
    assert r.choices[0].token_ids == want.token_ids and r.choices[0].message.content == want.text
    prompt = tiny_llm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("<|im_start|>assistant\nBlue is")
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        tiny_llm.apply_chat_template(messages, continue_final_message=True)


def test_chat_matches_llm(client, tiny_llm):
    want = tiny_llm.chat(CHAT, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].token_ids == want.token_ids and r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model=TINY, messages=CHAT, max_completion_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])] == want.token_ids
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    short = client.chat.completions.create(model=TINY, messages=CHAT, max_completion_tokens=3, max_tokens=50,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy took the top token
    chunks = list(client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=1, stream=True))
    assert sum(len(c.choices[0].logprobs.content) for c in chunks[1:] if c.choices and c.choices[0].logprobs) == 4
    chunks = list(client.chat.completions.create(model=TINY, messages=CHAT, max_tokens=16, temperature=1.0, n=3,
                                                 seed=7, stop=["o"], stream=True))
    assert sorted(c.index for chunk in chunks for c in chunk.choices if c.finish_reason) == [0, 1, 2]


def test_metrics(tiny, client):
    client.completions.create(model=TINY, prompt="hello world", max_tokens=4)
    r = httpx.get(tiny.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("kiln_num_requests_running", "kiln_num_requests_waiting", "kiln_kv_blocks_in_use",
                 "kiln_prefix_cache_hit_rate", "kiln_time_to_first_token_seconds_count",
                 "kiln_time_per_output_token_seconds_count", "kiln_e2e_request_latency_seconds_count",
                 "kiln_prompt_tokens_total", "kiln_generation_tokens_total"):
        assert name in r.text
    assert metric(tiny.url, "kiln_time_to_first_token_seconds_count") >= 1
    assert metric(tiny.url, "kiln_generation_tokens_total") >= 4
    assert "kiln_prompt_tokens_total" not in prometheus_client.generate_latest().decode()  # own registry


# ---- errors --------------------------------------------------------------------------------------
_MSG = {"messages": CHAT}
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -2}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),  # over the context
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),  # a token id outside the vocabulary
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {**_MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {**_MSG, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/chat/completions", {**_MSG, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {**_MSG, "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_invalid_parameters_are_400(tiny, path, body, param):
    assert_error(httpx.post(tiny.url + path, json={"model": TINY, **body}), 400, param)


def test_raw_errors(tiny):
    url = tiny.url + "/v1/completions"
    json_header = {"content-type": "application/json"}
    assert_error(httpx.post(url, content=b'{"prompt": "hi",', headers=json_header), 400)
    assert_error(httpx.post(url, content=b"[1, 2]", headers=json_header), 400)
    for path, fields in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        body = {"model": "gpt-4", **fields}  # each route refuses the other's fields (unknown_parameter)
        assert assert_error(httpx.post(tiny.url + path, json=body), 404, "model")["code"] == "model_not_found"
    big = b'{"prompt": "' + b"x" * MAX_REQUEST_BYTES + b'"}'
    assert_error(httpx.post(url, content=big, headers=json_header), 413)  # refused on Content-Length
    chunks = (big[i:i + 4096] for i in range(0, len(big), 4096))  # chunked: no Content-Length
    assert_error(httpx.post(url, content=chunks, headers=json_header), 413)


def test_client_errors_and_recovery(tiny, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=TINY, prompt="hi", max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=TINY, messages=CHAT, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    # The server keeps serving after bad requests, and they left nothing behind.
    assert client.completions.create(model=TINY, prompt="hi", max_tokens=2).choices[0].text
    engine = tiny.app.state.engine
    assert engine.stats()["num_running"] == 0 and engine.stats()["num_waiting"] == 0


# ---- disconnects and load ------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(tiny):
    engine = tiny.app.state.engine
    free = idle_free_blocks(engine)
    aborts = metric(tiny.url, "kiln_requests_total", {"finish_reason": "abort"})
    body = {"prompt": "hello " * 40, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", tiny.url + "/v1/completions", json=body) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(events)
            assert engine.stats()["num_free_blocks"] < free  # the request holds blocks now
    assert _wait_free(engine, free, within_s=2.0) < 2.0
    assert metric(tiny.url, "kiln_requests_total", {"finish_reason": "abort"}) == aborts + 1


def test_disconnect_before_answer_frees_blocks(tiny):
    engine = tiny.app.state.engine
    free = idle_free_blocks(engine)
    aborts = metric(tiny.url, "kiln_requests_total", {"finish_reason": "abort"})
    body = {"prompt": "hello " * 40, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    _wait_free(engine, free, within_s=2.0)
    assert metric(tiny.url, "kiln_requests_total", {"finish_reason": "abort"}) == aborts + 1


def test_64_concurrent_streams_match_llm(tiny, tiny_llm):
    prompts = [f"Request {i}: the quick brown fox number {i * 7}" for i in range(64)]
    expected = _greedy(tiny_llm, prompts, 8)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, list[int], str]:
        text, ids, finish = "", [], None
        stream = await client.completions.create(model=TINY, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            for c in chunk.choices:
                text, ids, finish = text + c.text, ids + (c.token_ids or []), c.finish_reason or finish
        return text, ids, finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=tiny.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(run_all())
    for (text, ids, finish), want in zip(results, expected):
        assert ids == want.token_ids and text == want.text and finish == want.finish_reason


# ---- engine states: loading, auth, crash, shutdown (a stand-in engine) ---------------------------
def test_loading_auth_crash(monkeypatch):
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    loaded, fail = threading.Event(), threading.Event()
    fake = FakeEngine(fail)
    engine = AsyncEngine(lambda: fake if loaded.wait(30) else None, model_name="fake")
    server = ServerThread(build_app(engine, ServerConfig(api_key="secret")))
    auth = {"Authorization": "Bearer secret"}
    url = server.url + "/v1/completions"
    try:
        assert_error(httpx.get(server.url + "/health"), 503)  # still loading
        assert_error(httpx.post(url, json={"prompt": "hi"}, headers=auth), 503)
        assert_error(httpx.post(url, json={"prompt": "hi"}), 401)
        assert_error(httpx.post(url, json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"}), 401)
        with pytest.raises(openai.AuthenticationError):
            server.client("nope").models.list()

        loaded.set()
        engine.wait_ready(timeout=10)
        assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
        client = server.client("secret")
        assert client.completions.create(model="fake", prompt="hi", max_tokens=3).choices[0].text == "xxx"
        time.sleep(0.1)  # let the engine thread finish its last turn
        polls = fake.num_polls
        time.sleep(0.3)
        assert fake.num_polls == polls  # idle: the engine thread sleeps on its queue, no spinning

        # The engine dies with one stream open and one plain request waiting: both get an error.
        stream = iter(client.completions.create(model="fake", prompt="hi", max_tokens=10**9, stream=True))
        next(stream)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, url, json={"prompt": "hi", "max_tokens": 10**9}, headers=auth, timeout=30)
            deadline = time.monotonic() + 10
            while len(fake.requests) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            fail.set()
            with pytest.raises(openai.APIError, match="injected fault"):
                list(stream)
            assert_error(pending.result(), 503)
        assert_error(httpx.get(server.url + "/health"), 503)
        assert_error(httpx.post(url, json={"prompt": "hi"}, headers=auth), 503)
        assert metric(server.url, "kiln_engine_healthy") == 0
    finally:
        loaded.set()
        server.stop()
    assert fake.shut_down


def test_env_api_key_cors_and_stopping_server_shuts_engine_down(monkeypatch, tiny):
    monkeypatch.setenv("KILN_API_KEY", "from-env")
    fake = FakeEngine(threading.Event())
    engine = AsyncEngine(lambda: fake, model_name="fake")
    origin = "http://allowed.example"
    server = ServerThread(build_app(engine, ServerConfig(cors_origins=(origin,))))
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/completions", headers=preflight)  # preflights carry no key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert "access-control-allow-origin" not in httpx.get(tiny.url + "/health", headers={"Origin": origin}).headers
    with pytest.raises(openai.AuthenticationError):
        server.client().completions.create(model="fake", prompt="hi", max_tokens=2)
    assert server.client("from-env").completions.create(model="fake", prompt="hi", max_tokens=2).choices[0].text == "xx"
    server.stop()
    assert not engine.is_healthy() and fake.shut_down


def test_async_engine_generate_abort_shutdown():
    fake = FakeEngine(threading.Event())
    engine = AsyncEngine(lambda: fake)
    engine.wait_ready(timeout=10)

    async def scenario():
        outs = [o async for o in engine.generate("a", "hi", SamplingParams(max_tokens=3))]
        assert outs[-1].finished and outs[-1].outputs[0].text == "xxx"
        async for _ in engine.generate("b", "hi", SamplingParams(max_tokens=10**9)):
            break  # leaving the loop closes the generator, which aborts the request
        stream = await engine.add_request("c", "hi", SamplingParams(max_tokens=10**9))
        engine.abort("c")  # aborted by someone else: the consumer still sees it end
        assert [o async for o in stream][-1].outputs[0].finish_reason == "abort"
        pending = await engine.add_request("d", "hi", SamplingParams(max_tokens=10**9))
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            [o async for o in pending]
        with pytest.raises(EngineDeadError):
            await engine.add_request("e", "hi", SamplingParams(max_tokens=1))

    asyncio.run(scenario())
    assert fake.shut_down and set(fake.requests) == {"d"}  # "b" and "c" were aborted


def test_run_server_drains_then_stops_on_sigint():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = (
        "from kiln.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig\n"
        "from kiln.entrypoints.openai import run_server\n"
        f"run_server(EngineConfig(model=ModelConfig({TINY!r}), cache=CacheConfig(num_blocks=256), "
        f"server=ServerConfig(port={port})), drain_s=0.5)\n"
    )
    root = REPO
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("KILN_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, "run_server did not come up"
            time.sleep(0.2)
        body = {"prompt": "hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            proc.send_signal(signal.SIGINT)  # the stream outlives the drain: it must end cleanly
            events += [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "engine_unavailable" in events[-2]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ---- the real default model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    server, _ = serve(SMOL)
    yield server
    server.stop()


def test_smollm2_matches_llm(smol):
    llm = _llm(SMOL)
    want_chat = llm.chat(CHAT, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    want_text = _greedy(llm, ["The capital of France is"], 8)[0]
    client = smol.client()
    chat = client.chat.completions.create(model=SMOL, messages=CHAT, max_tokens=8, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert chat.choices[0].token_ids == want_chat.token_ids and chat.choices[0].message.content == want_chat.text
    chunks = client.completions.create(model=SMOL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                       stream=True, extra_body={"return_token_ids": True})
    ids = [t for c in chunks for choice in c.choices for t in (choice.token_ids or [])]
    assert ids == want_text.token_ids
