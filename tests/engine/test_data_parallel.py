"""parallel.data_parallel_size: engine cores behind one server (kiln.engine.dp_client) answer as one
engine does, share the work by load and prefix affinity, and a dead replica fails only its own."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from kiln import LLM, SamplingParams
from kiln.engine.dp_client import AFFINITY_SLACK_SEQS, Router, _merge, prefix_key
from kiln.runtime.worker import free_port
from tests.helpers.server import server_log, start_server_process

TINY = "random:tiny"
NUM_BLOCKS = 64
PROMPTS = ["Once upon a time", "The capital of France is", "1 2 3 4", "Hello, my name is"]


def test_the_router_prefers_the_less_loaded_replica():
    router = Router()
    assert router.order([(3, 30), (1, 90), (1, 10)], None) == [2, 1, 0]  # sequences, then tokens
    assert router.order([(0, 0), None], None) == [0]  # a dead replica takes nothing


def test_the_router_keeps_prefix_affinity_unless_much_busier():
    router = Router()
    key = prefix_key(list(range(20)), 16)
    assert key == prefix_key(list(range(16)) + [99], 16) and prefix_key([1, 2], 16) is None
    router.sent(key, 1)
    assert router.order([(0, 0), (2, 20)], key)[0] == 1  # its prefix is cached there
    assert router.order([(0, 0), (AFFINITY_SLACK_SEQS + 1, 0)], key)[0] == 0  # too busy: the least loaded
    assert router.order([(0, 0), None], key) == [0]  # its replica died
    assert router.order([(0, 0), (2, 20)], prefix_key(list(range(1, 17)), 16))[0] == 0  # another prefix


def test_stats_sum_over_replicas():
    merged = _merge([{"num_running": 2, "prefix_cache_hit_rate": 0.5, "compile_building": 0, "spec_accepted_per_position": [1]},
                     {"num_running": 3, "prefix_cache_hit_rate": 0.0, "compile_building": 1, "spec_accepted_per_position": [1, 2]}])
    assert merged == {"num_running": 5, "prefix_cache_hit_rate": 0.25, "compile_building": 1,
                      "spec_accepted_per_position": [2, 2]}


def _start_server(port: int) -> subprocess.Popen:
    return start_server_process(port, TINY, NUM_BLOCKS, parallel="data_parallel_size=2")


def _replica_pids(server_pid: int) -> list[int]:
    """The engine-core processes the server spawned (found as the engine-core tests find theirs)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    pids = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as c:
            cmdline = c.read()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


def _replica_metric(metrics: str, name: str) -> dict[int, float]:
    return {int(r): float(v) for r, v in re.findall(rf'^{name}{{replica="(\d+)"}} (\S+)$', metrics, re.M)}


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    body = {"model": TINY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += event["choices"][0]["text"]
    return text


@pytest.fixture(scope="module")
def want() -> dict[str, str]:
    """Each prompt's answer from one engine, one request at a time."""
    llm = LLM(TINY, cache={"num_blocks": NUM_BLOCKS}, compile={"mode": "eager"})
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return {p: llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS}


def test_two_replicas_behind_one_server(want):
    """64 concurrent streams equal one engine's answers and reach both replicas; a killed replica
    fails its own requests, the other keeps serving, /health names the dead one, and the server
    exits with status 1 once no replica is left."""
    port = free_port()
    proc = _start_server(port)
    url = f"http://127.0.0.1:{port}"
    try:
        pids = _replica_pids(proc.pid)
        assert len(pids) == 2

        async def streams() -> list[str]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                return list(await asyncio.gather(*(_stream(client, PROMPTS[i % len(PROMPTS)], 16) for i in range(64))))

        got = asyncio.run(streams())
        assert got == [want[PROMPTS[i % len(PROMPTS)]] for i in range(64)]
        routed = _replica_metric(httpx.get(f"{url}/metrics").text, "kiln_dp_replica_requests_routed_total")
        assert sum(routed.values()) == 64 and min(routed.values()) > 0, routed

        async def kill_one() -> list[httpx.Response]:
            body = {"model": TINY, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                pending = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(4)]
                deadline = time.monotonic() + 60
                while True:  # every replica runs some of them
                    running = _replica_metric((await client.get("/metrics")).text, "kiln_dp_replica_num_requests_running")
                    if len(running) == 2 and min(running.values()) > 0:
                        break
                    assert time.monotonic() < deadline, running
                    await asyncio.sleep(0.05)
                os.kill(pids[1], signal.SIGKILL)
                return list(await asyncio.gather(*pending))

        answers = asyncio.run(kill_one())
        codes = sorted(a.status_code for a in answers)
        assert codes[0] == 200 and codes[-1] == 503, [a.text for a in answers]
        assert all("engine" in a.json()["error"]["message"] for a in answers if a.status_code != 200)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and f"pid {pids[1]}" in health.json()["error"]["message"]
        assert "kiln_engine_healthy 1.0" in httpx.get(f"{url}/metrics").text
        async def one() -> str:  # the other replica takes what comes now
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                return await _stream(client, PROMPTS[0], 16)

        assert asyncio.run(one()) == want[PROMPTS[0]]

        os.kill(pids[0], signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        assert "the engine core died" in server_log(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
