"""Serving against offline throughput on one workload: does the server keep up with the engine?

Runs, in one call and on the same prompts (random token ids, exactly ``--input-len`` each, every
request asking for exactly ``--output-len`` tokens with ``ignore_eos``, greedy):
1. offline: ``LLM.generate`` over all prompts at once, in a child process;
2. for each server tree (this checkout, then each ``--baseline-tree``: another kiln checkout's root,
   for a before/after in one call): ``python -m kiln.bench.serve`` (``run_server``) started in a
   child process, waited for until healthy and built, warmed with one untimed pass of the
   workload (lazy CUDA-graph captures happen there), then one pass not streamed and one streamed.
   The load comes from ``--client-procs`` client processes started together, each sending its share
   of the requests at once; output tokens are counted from each answer's ``usage``.
``--variant NAME=JSON`` (repeatable) serves this checkout again with the JSON's EngineConfig
keywords merged over ``--engine``'s, e.g. ``--variant 'two frontends={"server": {"api_server_count": 2}}'``.
With ``--core-client``, also the engine-core process driven by ``EngineCoreClient`` in a
child process, without HTTP (the split's own cost). ``--mixed-rates 4,16,64`` then loads each
server with a mixed, streamed workload (prompts of 64-1,024 tokens, 32-384 output tokens, Poisson
arrivals at each rate): TTFT and TPOT (client-side: from the first chunk to the last over the
tokens between) p50/p99. Prints a table (output tok/s, the ratio to offline, the server's mean TPOT from ``/metrics``, TTFT
p50/p99) and writes one JSON record to ``--out``.

    python -m benchmarks.serve split --model random:tiny --num-requests 64 --input-len 64 --output-len 64
    python -m benchmarks.serve split --model random:llama3-8b --num-requests 512 --input-len 256 \\
        --output-len 256 --baseline-tree .bench-old
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    REPO, child_command, child_env, console_table, device_name, make_record, out_dir, stop_process, write_record,
)



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--client-procs", type=int, default=4, help="load client processes")
    p.add_argument("--engine", default="{}", help="JSON of EngineConfig keywords beside the model (both paths)")
    p.add_argument("--baseline-tree", action="append", default=[], help="another kiln checkout's root to serve too")
    p.add_argument("--mixed-rates", type=lambda v: [float(x) for x in v.split(",")], default=[],
                   help="also a mixed workload (prompts 64-1,024, outputs 32-384) at these Poisson rates, e.g. 4,16,64")
    p.add_argument("--mixed-requests", type=int, default=128, help="requests per mixed-workload rate")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-uniform", action="store_true", help="servers: only the warm pass and the mixed workload")
    p.add_argument("--skip-server", action="store_true", help="not this tree's server (baseline trees still run)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="this tree's server again with these EngineConfig keywords merged over --engine's")
    p.add_argument("--streamed-only", action="store_true", help="uniform workload: the streamed pass only")
    p.add_argument("--core-client", action="store_true",
                   help="also the engine-core process driven by its client without HTTP (this tree only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: results/serve_split-<model>-<device>.json)")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # a load client's job file
    return p.parse_args(argv)


def make_prompts(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(1000, 20000) for _ in range(args.input_len)] for _ in range(args.num_requests)]


def engine_kwargs(args, variant: str = "{}") -> dict:
    kwargs = {"model": {"model": args.model}, **json.loads(args.engine)}
    for section, values in json.loads(variant).items():
        kwargs[section] = {**kwargs.get(section, {}), **values}
    return kwargs


def _env(tree: Path) -> dict:
    """The environment of a child that runs ``tree``'s kiln (first on the path)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}


# ---- offline -----------------------------------------------------------------------------------
OFFLINE = """
import json, sys, time
from kiln import LLM, SamplingParams
job = json.loads(open(sys.argv[1]).read())
llm = LLM(**job["engine"])
params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True)
llm.generate(job["prompts"], params, use_tqdm=False)  # warm, as the servers are: one untimed pass
t0 = time.perf_counter()
outs = llm.generate(job["prompts"], params, use_tqdm=False)
elapsed = time.perf_counter() - t0
print("RESULT " + json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "elapsed_s": elapsed}))
"""


# The engine-core process without HTTP: the split's own cost, apart from the frontend's.
CORE_CLIENT = """
import asyncio, json, sys, time
from kiln.config import EngineConfig
from kiln.engine.core_client import EngineCoreClient
from kiln.sampling_params import SamplingParams
if __name__ == "__main__":
    job = json.loads(open(sys.argv[1]).read())
    client = EngineCoreClient(EngineConfig.from_kwargs(**job["engine"]))
    client.wait_ready()
    params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True)

    async def run(tag):
        async def one(i, prompt):
            final = None
            async for out in await client.add_request(f"{tag}-{i}", prompt, params):
                final = out
            return len(final.outputs[0].token_ids)
        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(job["prompts"]))))

    while client.stats().get("compile_building", 1):  # as the servers wait for a background build
        time.sleep(0.5)
    asyncio.run(run("warm"))
    t0 = time.perf_counter()
    tokens = asyncio.run(run("timed"))
    elapsed = time.perf_counter() - t0
    client.shutdown()
    print("RESULT " + json.dumps({"tokens": tokens, "elapsed_s": elapsed}))
"""


def run_offline(args, prompts, tree: Path, script: str = OFFLINE) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"engine": engine_kwargs(args), "prompts": prompts, "output_len": args.output_len}))
        path = Path(tmp) / "run.py"  # a file, so the engine-core process can be spawned from it
        path.write_text(script)
        out = subprocess.run([sys.executable, str(path), str(job)], capture_output=True, text=True,
                             env=_env(tree), timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"offline run failed:\n{out.stderr[-3000:]}")
    r = json.loads(line[7:])
    return {"output_tok_s": r["tokens"] / r["elapsed_s"], **r}


# ---- load clients --------------------------------------------------------------------------------
async def _client_job(job: dict) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=job["url"], timeout=3600, limits=limits) as http:

        async def one(request: dict) -> dict:
            await asyncio.sleep(max(0.0, job["start_at"] + request["delay_s"] - time.time()))
            body = {"model": job["model"], "prompt": request["prompt"], "max_tokens": request["max_tokens"],
                    "temperature": 0.0, "ignore_eos": True, "stream": job["stream"]}
            t0 = time.time()
            if not job["stream"]:
                r = await http.post("/v1/completions", json=body)
                r.raise_for_status()
                return {"tokens": r.json()["usage"]["completion_tokens"], "ttft_s": None, "tpot_s": None,
                        "end": time.time()}
            body["stream_options"] = {"include_usage": True}
            first, tokens = None, 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices"):
                        first = time.time()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            end = time.time()
            return {"tokens": tokens, "ttft_s": first - t0, "end": end,
                    "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None}

        return await asyncio.gather(*(one(r) for r in job["requests"]))


def uniform_requests(args, prompts) -> list[dict]:
    return [{"prompt": p, "max_tokens": args.output_len, "delay_s": 0.0} for p in prompts]


def mixed_requests(args, rate: float) -> list[dict]:
    """Prompts of 64-1,024 random tokens, 32-384 output tokens, Poisson arrivals at ``rate`` per second."""
    rng = random.Random(args.seed + int(rate * 1000))
    t, requests = 0.0, []
    for _ in range(args.mixed_requests):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(1000, 20000) for _ in range(rng.randint(64, 1024))]
        requests.append({"prompt": prompt, "max_tokens": rng.randint(32, 384), "delay_s": t})
    return requests


def _percentiles(name: str, values: list[float]) -> dict:
    if not values:
        return {}
    return {f"{name}_ms_p50": float(np.percentile(values, 50)) * 1e3,
            f"{name}_ms_p99": float(np.percentile(values, 99)) * 1e3}


def load(url: str, model: str, requests: list[dict], args, stream: bool) -> dict:
    """Send the requests from ``--client-procs`` processes (each at its ``delay_s`` after a common
    start); output tok/s over the wall time, TTFT and TPOT percentiles when streamed."""
    start_at = time.time() + 3.0  # every client is up and waiting by then
    shares = [requests[i::args.client_procs] for i in range(args.client_procs)]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, share in enumerate(shares):
            job = Path(tmp) / f"client{i}.json"
            job.write_text(json.dumps({"url": url, "model": model, "requests": share, "stream": stream,
                                       "start_at": start_at}))
            procs.append(subprocess.Popen(child_command("benchmarks.serve.split", "--client", str(job)),
                                          stdout=subprocess.PIPE, text=True, env=child_env()))
        results = [r for p in procs for r in json.loads(p.communicate(timeout=3600)[0])]
    tokens = sum(r["tokens"] for r in results)
    elapsed = max(r["end"] for r in results) - start_at
    out = {"output_tok_s": tokens / elapsed, "tokens": tokens, "elapsed_s": elapsed}
    out.update(_percentiles("ttft", [r["ttft_s"] for r in results if r["ttft_s"] is not None]))
    out.update(_percentiles("tpot", [r["tpot_s"] for r in results if r["tpot_s"] is not None]))
    return out


def _tpot_sum_count(url: str) -> tuple[float, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "kiln_time_per_output_token_seconds_sum":
                total = s.value
            elif s.name == "kiln_time_per_output_token_seconds_count":
                count = s.value
    return total, count


def run_server_tree(args, prompts, tree: Path, variant: str = "{}") -> dict:
    from kiln.bench.serve import wait_built, wait_healthy
    from kiln.runtime.worker import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kwargs = engine_kwargs(args, variant)
    kwargs["server"] = {**kwargs.get("server", {}), "host": "127.0.0.1", "port": port}
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "engine.json"
        config.write_text(json.dumps(kwargs))
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "kiln.bench.serve", str(config)],
                                env=_env(tree), cwd=str(tree))
        try:
            wait_healthy(url, proc, 900)
            results["startup_s"] = time.perf_counter() - t0
            results["build_wait_s"] = wait_built(url, proc, 900)
            requests = uniform_requests(args, prompts)
            load(url, args.model, requests, args, stream=True)  # warm: lazy captures, allocator
            for stream in () if args.skip_uniform else (True,) if args.streamed_only else (False, True):
                before = _tpot_sum_count(url)
                r = load(url, args.model, requests, args, stream)
                after = _tpot_sum_count(url)
                if after[1] > before[1]:
                    r["tpot_ms_mean"] = (after[0] - before[0]) / (after[1] - before[1]) * 1e3
                results["streamed" if stream else "not_streamed"] = r
            for rate in args.mixed_rates:
                results[f"mixed_{rate:g}_req_s"] = load(url, args.model, mixed_requests(args, rate), args, stream=True)
                print(f"  mixed at {rate:g} req/s: {json.dumps(results[f'mixed_{rate:g}_req_s'])}", flush=True)
        finally:
            stop_process(proc)
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(_client_job(json.loads(Path(args.client).read_text())))))
        return
    prompts = make_prompts(args)
    record: dict = {"offline": None, "servers": {}}
    if not args.skip_offline:
        record["offline"] = run_offline(args, prompts, REPO)
        print(f"offline: {record['offline']['output_tok_s']:.0f} output tok/s", flush=True)
    if args.core_client:
        record["core_client"] = run_offline(args, prompts, REPO, CORE_CLIENT)
        print(f"engine-core process, no HTTP: {record['core_client']['output_tok_s']:.0f} output tok/s", flush=True)
    trees = ([] if args.skip_server else [("this", REPO, "{}")]) + [(t, Path(t).resolve(), "{}") for t in args.baseline_tree]
    trees += [(name, REPO, variant) for name, _, variant in (v.partition("=") for v in args.variant)]
    for name, tree, variant in trees:
        record["servers"][name] = run_server_tree(args, prompts, tree, variant)
        print(f"server {name}: {json.dumps(record['servers'][name])}", flush=True)
    offline = record["offline"]["output_tok_s"] if record["offline"] else None
    rows = [["offline LLM.generate", f"{offline:.0f}" if offline else "-", "1.00", "", "", ""]] if offline else []
    if record.get("core_client"):
        x = record["core_client"]["output_tok_s"]
        rows.append(["EngineCoreClient, no HTTP", f"{x:.0f}", f"{x / offline:.2f}" if offline else "-", "", "", ""])
    mixed = []
    for name, r in record["servers"].items():
        for kind in [k for k in r if k.startswith("mixed_")]:
            x = r[kind]
            mixed.append([f"server ({name})", kind.removeprefix("mixed_").replace("_", " "), f"{x['output_tok_s']:.0f}",
                          *(f"{x.get(k, float('nan')):.0f}" for k in ("ttft_ms_p50", "ttft_ms_p99",
                                                                         "tpot_ms_p50", "tpot_ms_p99"))])
        for kind in [k for k in ("not_streamed", "streamed") if k in r]:
            x = r[kind]
            rows.append([f"server ({name}) {kind.replace('_', ' ')}", f"{x['output_tok_s']:.0f}",
                         f"{x['output_tok_s'] / offline:.2f}" if offline else "-",
                         f"{x.get('tpot_ms_mean', float('nan')):.1f}",
                         f"{x.get('ttft_ms_p50', float('nan')):.0f}", f"{x.get('ttft_ms_p99', float('nan')):.0f}"])
    print(console_table(["path", "output tok/s", "x offline", "TPOT ms (mean)", "TTFT p50 ms", "TTFT p99 ms"], rows))
    if mixed:
        print(console_table(["server", "rate", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                             "TPOT p99 ms"], mixed))
    device = "".join(c if c.isalnum() or c in "-_." else "_" for c in device_name())
    out = Path(args.out) if args.out else out_dir() / f"serve_split-{args.model.replace(':', '_')}.json"
    config = {k: v for k, v in vars(args).items() if k != "client"}
    write_record(make_record("serve_split", args.model, config, record), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
