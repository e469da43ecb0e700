"""kiln mode on the CPU cut at every attention call or at every Nth: decode speed, interleaved.

Builds one ``LLM`` per system in this process (``eager``, and kiln with each ``--split-every``;
kiln built before the first request, from the compile cache when it holds the build), then runs
``--rounds`` rounds; in each round every system, in turn, times

- batch 1: one greedy request of ``--prompt-len`` tokens and ``--output-len`` new ones through
  ``LLMEngine.step``, each decode step timed on its own;
- batch ``--batch``: that many such requests at once through ``LLM.generate``, output tok/s
  (prefill included).

With ``--mkl``, each system gets a twin whose float32 linears go through ``F.linear`` (MKL's GEMV
and GEMM, kiln before ``kiln_cpu::linear_f32``), built and run with float32 left out of
``kiln.ops.cpu_linear.CPU_LINEAR_OPS``, its artifacts in a cache dir of its own.

Systems take turns within a round, so a machine whose speed drifts (a shared VM) moves every
system alike. The table gives the decode step's 10th percentile and median over all rounds (a
shared VM's neighbours only add time: the low percentile is the steadier number) and the batch's
median tok/s. Writes ``cpu_split_every-<model><label>.{json,md}`` into ``$OUT``.

    python -m benchmarks.decode split-every                          # SmolLM2: eager, split 1, split 10
    python -m benchmarks.decode split-every --split-every 1,5,10 --rounds 7
    python -m benchmarks.decode split-every --split-every 10 --mkl      # the float32 GEMV against MKL's
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time


import torch

from benchmarks.common import console_table, out_dir
from kiln.bench.report import device_name


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--split-every", default="1,10", help="comma-separated compile.split_every values")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--label", default="")
    p.add_argument("--mkl", action="store_true", help="add each system's twin with float32 linears through MKL")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from kiln import LLM, SamplingParams
    from kiln.config import default_cache_dir
    from kiln.ops import cpu_linear

    systems = {"eager": {"mode": "eager"}}
    for every in args.split_every.split(","):
        systems[f"kiln split_every={int(every)}"] = {"mode": "kiln", "startup": "complete", "split_every": int(every)}
    if args.mkl:
        systems.update({f"{name}, MKL": compile for name, compile in list(systems.items())})

    @contextlib.contextmanager
    def linears_of(name: str):
        """A twin's float32 linears go through F.linear while it is built and while it runs."""
        saved = dict(cpu_linear.CPU_LINEAR_OPS)
        if name.endswith(", MKL"):
            cpu_linear.CPU_LINEAR_OPS.pop(torch.float32, None)
        try:
            yield
        finally:
            cpu_linear.CPU_LINEAR_OPS.clear()
            cpu_linear.CPU_LINEAR_OPS.update(saved)

    llms, startup = {}, {}
    for name, compile in systems.items():
        t0 = time.perf_counter()
        # A twin's graphs differ from its system's, but not the artifact key: its own cache dir.
        cache = {"dir": os.path.join(default_cache_dir(), "bench-mkl")} if name.endswith(", MKL") else {}
        with linears_of(name):
            llms[name] = LLM(model=args.model, compile=compile, cache=cache)
        startup[name] = time.perf_counter() - t0
        print(f"{name}: built in {startup[name]:.1f} s", flush=True)

    prompt = [[(7 * i + 3) % 1000 + 100 for i in range(args.prompt_len)]]
    batch = [[(7 * i + 3 + 11 * j) % 1000 + 100 for i in range(args.prompt_len)] for j in range(args.batch)]

    def timed(llm, prompts, new: int) -> float:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    for name, llm in llms.items():  # warm-up: first calls at new shapes
        with linears_of(name):
            timed(llm, prompt, 4)
            timed(llm, batch, 4)
    def decode_steps(llm, request_id: str) -> list[float]:
        engine = llm.engine
        engine.add_request(request_id, prompt[0], SamplingParams(max_tokens=args.output_len, temperature=0.0,
                                                                 ignore_eos=True))
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return times[1:]  # the first step is the prefill

    rows = {name: [] for name in llms}
    for r in range(args.rounds):
        for name, llm in llms.items():
            with linears_of(name):
                steps = decode_steps(llm, f"round{r}")
                tok_s = args.batch * args.output_len / timed(llm, batch, args.output_len)
            rows[name].append({"round": r, "b1_steps_ms": [1e3 * t for t in steps], f"b{args.batch}_tok_s": tok_s})
            print(f"round {r} {name}: batch 1 step median {1e3 * statistics.median(steps):.1f} ms, "
                  f"batch {args.batch} {tok_s:.1f} tok/s", flush=True)

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[int(q * (len(values) - 1))]

    key_b = f"b{args.batch}_tok_s"
    table = []
    base = [t for x in rows["eager"] for t in x["b1_steps_ms"]]
    for name, rs in rows.items():
        steps = [t for x in rs for t in x["b1_steps_ms"]]
        bb = statistics.median(x[key_b] for x in rs)
        rb = bb / statistics.median(x[key_b] for x in rows["eager"])
        table.append([name, f"{startup[name]:.1f}", f"{pct(steps, 0.1):.1f}", f"{pct(steps, 0.5):.1f}",
                      f"{pct(base, 0.1) / pct(steps, 0.1):.2f}x", f"{bb:.1f}", f"{rb:.2f}x"])
    header = ["system", "built (s)", "batch 1 step p10 (ms)", "p50 (ms)", "x eager (p10)",
              f"batch {args.batch} tok/s", "x eager"]
    print(console_table(header, table))
    out = out_dir() / f"cpu_split_every-{args.model}{'-' + args.label if args.label else ''}"
    out.with_suffix(".json").write_text(json.dumps({"device": device_name(), "args": vars(args), "startup_s": startup,
                                                    "rounds": rows}, indent=1) + "\n")
    md = "\n".join("| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *table])
    out.with_suffix(".md").write_text(
        f"# kiln on the CPU cut at every attention call or every Nth: {args.model}\n\n"
        f"`python -m benchmarks.decode split-every --split-every {args.split_every} --rounds {args.rounds}"
        f"{' --mkl' if args.mkl else ''}`, "
        f"{device_name()}; batch 1: prompt {args.prompt_len}, {args.output_len} new tokens, each decode step "
        f"timed, percentiles over all rounds; batch {args.batch}: output tok/s, prefill included, median of "
        f"the rounds.\n\n" + md + "\n")


if __name__ == "__main__":
    main()
