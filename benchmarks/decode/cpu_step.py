"""Where a CPU decode step of the default model goes: kernels, compiled glue and host, against the
step's weight-read bound, for each thread count (batch 1, or ``--batch`` sequences decoded together).

``make serve``'s model with kiln's defaults (``LLM()``: the GGUF's int4 blocks, its Q8_0 head, the
compiled forward built before timing). For each ``--threads`` count, ``--rounds`` rounds of:

    step ms     wall time per decode step: (t(1 + n tokens) - t(1 token)) / n after a
                ``--prompt-len`` prompt, greedy (the median round)
    read GB/s   a 1 GiB sum in the same process (read only, beyond the last-level cache)
    bound ms    the bytes a step reads (weights, the Q8_0 head; not the embedding table) / read GB/s

then one round under torch.profiler, the same difference of two runs, split per step into the
int4 linears, the LM head, paged attention, the compiled graphs' own code (norms, rotary, SiLU,
residuals), other aten ops, and host: the profiled wall time no op accounts for (the scheduler,
input layout, sampler, detokenizer and Python between ops). The profiler slows small ops, so its
parts add up to more than ``step ms``; the split is what to compare.

    python -m benchmarks.decode cpu-step
    python -m benchmarks.decode cpu-step --threads 1 --rounds 1 --tokens 8   # smoke
    python -m benchmarks.decode cpu-step --threads 2 --batch 8                # 8 streams' step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks.common import console_table, markdown_table, out_dir, weight_bytes_per_step

# (part, substrings of a profiler event's name); first match wins.
PARTS = (
    ("int4 linears", ("linear_int4",)),
    ("LM head", ("gemv_q8_0", "kiln_cpu::linear_f32", "kiln_cpu::linear_bf16", "kiln_cpu::gemv")),
    ("attention", ("attend_paged", "attention_context")),
    ("compiled graphs", ("CompiledFxGraph",)),
)


def part(name: str) -> str:
    return next((p for p, keys in PARTS if any(k in name for k in keys)), "other ops")


def read_gb_s(big: torch.Tensor, iters: int = 3) -> float:
    big.sum()
    t0 = time.perf_counter()
    for _ in range(iters):
        big.sum()
    return big.numel() * big.element_size() * iters / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default=f"1,{os.cpu_count()}")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="decode steps per timed run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (distinct prompts)")
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)
    from kiln import LLM, SamplingParams
    from kiln.bench.report import cpu_model

    llm = LLM(compile={"startup": "complete"})
    model = llm.engine.executor.runner.model
    step_bytes = weight_bytes_per_step(model)
    prompts = [{"prompt_token_ids": list(range(1000 + 7 * b, 1000 + 7 * b + args.prompt_len))}
               for b in range(args.batch)]

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    def step_s() -> float:
        return (run(args.tokens + 1) - run(1)) / args.tokens

    big = torch.ones(2**28, dtype=torch.float32)  # 1 GiB, written so reads reach memory
    records = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        run(4), run(1)  # warm-up at this thread count
        steps, reads = [], []
        for _ in range(args.rounds):
            steps.append(step_s())
            reads.append(read_gb_s(big))
        from torch.profiler import ProfilerActivity, profile

        spent = {}
        for sign, n in ((1, args.tokens + 1), (-1, 1)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                run(n)
                wall = time.perf_counter() - t0
            spent["wall"] = spent.get("wall", 0.0) + sign * wall * 1e6
            for e in prof.key_averages():
                if e.key.startswith("ProfilerStep") or e.key.startswith("USDT"):
                    continue
                key = part(e.key)
                spent[key] = spent.get(key, 0.0) + sign * e.self_cpu_time_total
        per_step = {k: v / args.tokens / 1e3 for k, v in spent.items()}  # ms
        ops = sum(v for k, v in per_step.items() if k != "wall")
        step_ms, gb_s = 1e3 * statistics.median(steps), statistics.median(reads)
        records.append({"threads": threads, "step_ms": round(step_ms, 3), "tok_s": round(1e3 / step_ms, 1),
                        "read_gb_s": round(gb_s, 2), "bound_ms": round(step_bytes / gb_s / 1e6, 3),
                        "profiled_ms": round(per_step["wall"], 3),
                        **{f"{name}_ms": round(per_step.get(name, 0.0), 3) for name, _ in PARTS},
                        "other_ops_ms": round(per_step.get("other ops", 0.0), 3),
                        "host_ms": round(per_step["wall"] - ops, 3)})
        print(records[-1], flush=True)
    cols = ["threads", "step_ms", "tok_s", "read_gb_s", "bound_ms", "profiled_ms",
            *(f"{name}_ms" for name, _ in PARTS), "other_ops_ms", "host_ms"]
    header = ["threads", "step ms", "tok/s", "read GB/s", "bound ms", "profiled ms", *(n for n, _ in PARTS),
              "other ops", "host"]
    table = [[str(r[c]) for c in cols] for r in records]
    print(console_table(header, table))
    meta = {"cpu": cpu_model(), "cores": os.cpu_count(), "mb_per_step": round(step_bytes / 1e6, 1),
            "batch": args.batch, "prompt_len": args.prompt_len, "tokens": args.tokens, "rounds": args.rounds,
            "torch": torch.__version__,
            "load_avg": round(os.getloadavg()[0], 2)}
    out = os.path.join(args.out, "cpu_step" if args.batch == 1 else f"cpu_step-b{args.batch}")
    os.makedirs(args.out, exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    md = [f"# A CPU batch-{args.batch} decode step of the default model ({meta['cpu']}, {meta['cores']} cores)", "",
          f"`python -m benchmarks.decode cpu-step`: {meta['mb_per_step']} MB read a step; prompt {args.prompt_len}, "
          f"{args.tokens} steps, median of {args.rounds} rounds; load average {meta['load_avg']} at the end. "
          "Parts (ms a step) come from one profiled round; host is the profiled wall time no op accounts for.", "",
          *markdown_table(header, table)]
    with open(out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
