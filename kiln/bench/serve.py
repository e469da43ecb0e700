"""The ``serve`` benchmark: start the OpenAI server in a child process, then load it over HTTP.

    python -m kiln.bench.serve CONFIG.json   # the child: run_server(EngineConfig)

Measures ``server_startup_s`` (spawn to a healthy ``GET /health``); then, where kiln's forward is
built in the background (``compile.startup=auto`` on the CPU, or ``fast``), waits until ``/metrics``
reports ``kiln_compile_building 0`` (``build_wait_s``), so that the load runs the built forward, as
the in-process benchmarks do; then for each batch size sends ``num_requests`` completions that many
at a time: output tokens/s and request latency percentiles.
Prompts are text of about ``prompt_len`` tokens (one short word per token for common tokenizers).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kiln.config import EngineConfig, redacted
from kiln.runtime.worker import free_port

HEALTH_TIMEOUT_S = 600.0  # also the longest wait for a background build


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server was not healthy after {timeout_s:g} s")


def wait_built(base_url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until the server's ``kiln_compile_building`` gauge reads 0 (at once without a build)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} while kiln's forward was built")
        families = text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=5.0).text)
        if not any(s.name == "kiln_compile_building" and s.value for f in families for s in f.samples):
            return time.perf_counter() - t0
        time.sleep(0.5)
    raise TimeoutError(f"kiln's forward was still being built after {timeout_s:g} s")


def measure_serve(engine, bench) -> dict:
    import httpx
    import numpy as np
    from tqdm.auto import tqdm

    port = free_port()
    engine = dataclasses.replace(engine, server=dataclasses.replace(engine.server, host="127.0.0.1", port=port))
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "engine.json"
        config_path.write_text(json.dumps(redacted(engine)))  # the API key goes in the environment
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "kiln.bench.serve", str(config_path)],
                                env={**os.environ, **engine.server.secret_env()})
        try:
            wait_healthy(base_url, proc, HEALTH_TIMEOUT_S)
            metrics = {"server_startup_s": time.perf_counter() - t0}
            metrics["build_wait_s"] = wait_built(base_url, proc, HEALTH_TIMEOUT_S)
            key = engine.server.resolved_api_key()
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            with httpx.Client(base_url=base_url, timeout=bench.timeout_s, headers=headers) as client:
                model = client.get("/v1/models").json()["data"][0]["id"]
                body = {"model": model, "prompt": " ".join(["hi"] * bench.prompt_len),
                        "max_tokens": bench.output_len, "temperature": 0.0, "ignore_eos": True}
                for bs in tqdm(bench.batch_sizes, desc="concurrency", dynamic_ncols=True):
                    latencies, tokens, elapsed = _load(client, body, bs, max(bs, bench.num_requests))
                    metrics[f"output_tok_s_bs{bs}"] = tokens / elapsed
                    for p in (50, 90, 99):
                        metrics[f"request_bs{bs}_ms_p{p}"] = float(np.percentile(latencies, p))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return metrics


def _load(client, body: dict, concurrency: int, num_requests: int) -> tuple[list[float], int, float]:
    def one(_: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        resp = client.post("/v1/completions", json=body)
        resp.raise_for_status()
        usage = resp.json().get("usage") or {}
        return (time.perf_counter() - t0) * 1e3, int(usage.get("completion_tokens", body["max_tokens"]))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(num_requests)))
    elapsed = time.perf_counter() - t0
    return [r[0] for r in results], sum(r[1] for r in results), elapsed


def main(argv: list[str]) -> None:
    from kiln.entrypoints.openai.api_server import run_server

    run_server(EngineConfig.from_kwargs(**json.loads(Path(argv[0]).read_text())))


if __name__ == "__main__":
    main(sys.argv[1:])
