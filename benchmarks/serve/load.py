"""How fast does the OpenAI server answer streaming requests that arrive at a given rate?

Starts the server in a child process (or targets ``--url``), then sends ``--num-requests``
streaming completions whose arrivals form a Poisson process of ``--rate`` requests/s (``inf``: all
at once). Prompts are synthetic text of about ``--input-len`` tokens (random common words, one
token each for common tokenizers, +- ``--input-jitter``); every request asks for exactly
``--output-len`` tokens (``ignore_eos``). Reports throughput (requests/s, output tokens/s) and
TTFT / TPOT / end-to-end latency percentiles (p50, p90, p99), prints a table, writes one JSON
record (format: ``common.py``) to ``--out`` and appends its row to ``serve.md`` beside it. The
server is started as ``python -m kiln.bench.serve``, which calls ``run_server``.

    python -m benchmarks.serve load --num-requests 16 --rate 2 --output-len 64
    python -m benchmarks.serve load --url http://127.0.0.1:8000 --rate inf --num-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import append_table_rows, console_table, device_name, make_record, write_record, out_dir

WORDS = ("the of and to in is was for on that with as by at from his her they this are have not but had "
         "one all were when there can more time some very what about which out into year people will "
         "their them then now only new could would other these two may first water like way over see "
         "city house river world light music paper story garden market window").split()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="the model the started server loads")
    p.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    p.add_argument("--rate", type=float, default=2.0, help="mean arrival rate in requests/s; inf: all at once")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in (about) tokens")
    p.add_argument("--input-jitter", type=float, default=0.25, help="prompt lengths vary by this fraction")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-mode", default="eager", help="compile.mode of the started server")
    p.add_argument("--cudagraph", default="none", help="compile.cudagraph of the started server (GPU)")
    p.add_argument("--device", default=None, help="device label for the results (default: this machine's)")
    p.add_argument("--out", default=None, help="JSON path (default: results/serve-<model>-<device>.json)")
    return p.parse_args(argv)


def make_prompts(args) -> list[str]:
    rng = random.Random(args.seed)
    lo = max(1, round(args.input_len * (1 - args.input_jitter)))
    hi = max(lo, round(args.input_len * (1 + args.input_jitter)))
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(args.num_requests)]


def arrival_times(args) -> list[float]:
    if args.rate == float("inf"):
        return [0.0] * args.num_requests
    rng = np.random.default_rng(args.seed)
    return np.cumsum(rng.exponential(1.0 / args.rate, args.num_requests)).tolist()


async def one_request(client, model: str, prompt: str, output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens, error = None, 0, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": (await r.aread()).decode()[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk.get("choices") and ttft is None and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    e2e = time.perf_counter() - t0
    if error is not None:
        return {"ok": False, "error": error}
    ttft = e2e if ttft is None else ttft
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else None
    return {"ok": True, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e, "output_tokens": tokens}


async def run_load(url: str, args, prompts: list[str]) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=args.num_requests + 1, max_keepalive_connections=args.num_requests + 1)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await one_request(client, model, prompts[0], 4)  # warm-up, not timed
        t0 = time.perf_counter()

        async def scheduled(at: float, prompt: str) -> dict:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await one_request(client, model, prompt, args.output_len)

        results = await asyncio.gather(*(scheduled(at, p) for at, p in zip(arrival_times(args), prompts)))
        return list(results), time.perf_counter() - t0


def summarize(results: list[dict], duration_s: float) -> dict:
    ok = [r for r in results if r["ok"]]
    metrics = {
        "num_ok": len(ok), "num_failed": len(results) - len(ok), "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s,
        "output_tok_s": sum(r["output_tokens"] for r in ok) / duration_s,
    }
    for key in ("ttft", "tpot", "e2e"):
        values = [r[f"{key}_s"] * 1e3 for r in ok if r[f"{key}_s"] is not None]
        for p in (50, 90, 99):
            metrics[f"{key}_ms_p{p}"] = float(np.percentile(values, p)) if values else None
    return metrics


def start_server(args) -> tuple[subprocess.Popen, str]:
    from kiln.config import CompileConfig, EngineConfig, ModelConfig, ServerConfig
    from kiln.bench.serve import HEALTH_TIMEOUT_S, wait_healthy
    from kiln.runtime.worker import free_port

    port = free_port()
    compile_config = CompileConfig(mode=args.compile_mode, cudagraph=args.cudagraph)
    config = EngineConfig(model=ModelConfig(args.model), compile=compile_config,
                          server=ServerConfig(host="127.0.0.1", port=port))
    path = Path(tempfile.mkdtemp()) / "engine.json"
    path.write_text(json.dumps(dataclasses.asdict(config)))
    proc = subprocess.Popen([sys.executable, "-m", "kiln.bench.serve", str(path)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, HEALTH_TIMEOUT_S)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()  # SIGTERM: uvicorn drains, then the engine thread shuts down
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv=None) -> None:
    args = parse_args(argv)
    prompts = make_prompts(args)
    load_1m = os.getloadavg()[0]  # CPU numbers on a shared machine need this beside them
    proc, url = (None, args.url.rstrip("/")) if args.url else start_server(args)
    try:
        results, duration_s = asyncio.run(run_load(url, args, prompts))
    finally:
        if proc is not None:
            stop_server(proc)
    metrics = {**summarize(results, duration_s), "host_load_avg_1m": load_1m}
    device = args.device or ("remote" if args.url else device_name())
    rate = args.rate if math.isfinite(args.rate) else "inf"  # JSON has no infinity
    config = {"system": "kiln-server", "url": args.url or "started", "rate": rate,
              "num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
              "compile_mode": args.compile_mode, "cudagraph": args.cudagraph}
    record = make_record("serve", args.model, config, metrics)
    record["device"] = device
    slug = re.sub(r"[^a-z0-9.]+", "-", f"{args.model}-{device.split(':')[0]}".lower()).strip("-")
    out = Path(args.out) if args.out else out_dir() / f"serve-{slug}.json"
    write_record(record, out)
    append_table_rows(out.parent / "serve.md", [record], list(config))
    rows = [[k] + [metrics[f"{k}_ms_p{p}"] for p in (50, 90, 99)] for k in ("ttft", "tpot", "e2e")]
    print(f"\n{args.model} on {device}: {metrics['num_ok']}/{len(results)} ok in {duration_s:.1f} s, "
          f"{metrics['requests_per_s']:.2f} req/s, {metrics['output_tok_s']:.1f} output tok/s")
    print(console_table(["latency (ms)", "p50", "p90", "p99"], rows))
    print(f"wrote {out}")
    if metrics["num_failed"]:
        print("failures:", [r["error"] for r in results if not r["ok"]][:3])


if __name__ == "__main__":
    main()
