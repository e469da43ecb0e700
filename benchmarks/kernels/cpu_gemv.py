"""One-row GEMVs on the CPU at SmolLM2-135M's shapes, interleaved, weights cold: float32 through MKL
(``F.linear``) and kiln's ``kiln_cpu::gemv_f32``; bfloat16 through ``F.linear`` (oneDNN) and kiln's
``kiln_cpu::gemv_bf16`` (AVX512-BF16, else AVX2 widening each bfloat16 to float32).

Batch-1 decode multiplies one activation row by every weight matrix, so each linear should read its
weight at the memory's speed. For each shape the script cycles through enough copies of the weight
(``--bytes`` in all) that each call reads from memory, not the cache, and times every method in
``--rounds`` interleaved rounds (median). The memory's own rate is measured in the same run as
``torch.dot`` of a ``--bytes`` vector with itself. Writes
``cpu_gemv-<cpu>.{json,md}`` in ``$OUT``.

    python -m benchmarks.kernels cpu-gemv
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F


from benchmarks.common import console_table, out_dir
from kiln.bench.report import cpu_model
from kiln.ops.cpu_linear import gemv_available

# SmolLM2-135M (hidden 576, 30 layers, vocab 49152): qkv and gate_up as kiln's merged linears.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def per_call_us(fn, weights, x, calls: int) -> float:
    for i in range(3):
        fn(x, weights[i % len(weights)])
    t0 = time.perf_counter()
    for i in range(calls):
        fn(x, weights[i % len(weights)])
    return (time.perf_counter() - t0) / calls * 1e6


def measure(rows: int, methods: dict, dtypes: dict, args, memory: list) -> dict:
    """Per shape: each method's median us per call at ``rows`` rows of x, weights cold."""
    results = {}
    vec = torch.randn(int(args.bytes // 4))
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(args.bytes // (n * k * 4)))
        weights = {torch.float32: [torch.randn(n, k) for _ in range(copies)]}
        weights[torch.bfloat16] = [w.to(torch.bfloat16) for w in weights[torch.float32]]
        x = torch.randn(rows, k)
        for m, fn in methods.items():  # each against float64 on its own dtype's weight
            w = weights[dtypes[m]][0]
            want = x.to(w.dtype).double() @ w.double().t()
            torch.testing.assert_close(fn(x, w).double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        calls = max(10, int(2e9 // (n * k * 4) // 10 // rows))
        times = {m: [] for m in methods}
        for _ in range(args.rounds):
            for m, fn in methods.items():
                times[m].append(per_call_us(fn, weights[dtypes[m]], x, calls))
            t0 = time.perf_counter()
            torch.dot(vec, vec)
            memory.append(vec.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        results[name] = {"n": n, "k": k, "us": {m: statistics.median(v) for m, v in times.items()},
                         "rounds_us": times}
        print(f"rows {rows}", name, {m: round(statistics.median(v), 1) for m, v in times.items()}, flush=True)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bytes", type=float, default=256e6, help="weight copies cycled per shape")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--rows", default="1", help="comma-separated row counts of x (the first gets the full table)")
    args = p.parse_args(argv)
    if not gemv_available():
        sys.exit("kiln._C is not built with kiln's CPU GEMVs (make setup builds it)")
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = {"fp32 MKL (F.linear)": F.linear, "fp32 kiln gemv_f32": torch.ops.kiln_cpu.gemv_f32,
               "bf16 F.linear": lambda x, w: F.linear(x.to(w.dtype), w),
               "bf16 kiln gemv_bf16": lambda x, w: torch.ops.kiln_cpu.gemv_bf16(x.to(w.dtype), w)}
    dtypes = {m: torch.bfloat16 if m.startswith("bf16") else torch.float32 for m in methods}
    memory = []
    row_counts = [int(r) for r in args.rows.split(",")]
    by_rows = {rows: measure(rows, methods, dtypes, args, memory) for rows in row_counts}
    results = by_rows[row_counts[0]]
    mem = statistics.median(memory)
    header = ["shape", "N x K", "fp32 MB", *[f"{m} us (GB/s)" for m in methods], "fp32 kiln / MKL"]
    rows = []
    for name, r in results.items():
        mb = r["n"] * r["k"] * 4 / 1e6
        us = r["us"]
        rows.append([name, f"{r['n']} x {r['k']}", f"{mb:.1f}",
                     *[f"{us[m]:.0f} ({mb / (2 if dtypes[m] == torch.bfloat16 else 1) / us[m] * 1e3:.1f})"
                       for m in methods],
                     f"{us['fp32 MKL (F.linear)'] / us['fp32 kiln gemv_f32']:.2f}x"])
    layer = {m: sum(results[s]["us"][m] for s in ("qkv", "o", "gate_up", "down")) for m in methods}
    rows.append(["a layer (4 linears)", "", "", *[f"{layer[m]:.0f}" for m in methods],
                 f"{layer['fp32 MKL (F.linear)'] / layer['fp32 kiln gemv_f32']:.2f}x"])
    by_rows_header = ["rows of x", *[f"a layer: {m} us" for m in methods], "LM head: fp32 MKL us", "fp32 kiln us"]
    by_rows_table = []
    for n_rows, res in by_rows.items():
        lay = {m: sum(res[s]["us"][m] for s in ("qkv", "o", "gate_up", "down")) for m in methods}
        by_rows_table.append([str(n_rows), *[f"{lay[m]:.0f}" for m in methods],
                              f"{res['lm_head']['us']['fp32 MKL (F.linear)']:.0f}",
                              f"{res['lm_head']['us']['fp32 kiln gemv_f32']:.0f}"])
    print(console_table(header, rows))
    print(console_table(by_rows_header, by_rows_table))
    print(f"memory (torch.dot over {args.bytes / 1e6:.0f} MB): {mem:.1f} GB/s")
    cpu = cpu_model()
    slug = re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-")
    out = out_dir() / f"cpu_gemv-{slug}"
    out.with_suffix(".json").write_text(json.dumps({"device": cpu, "threads": torch.get_num_threads(),
                                                    "memory_gb_s": mem, "args": vars(args),
                                                    "by_rows": {str(r): v for r, v in by_rows.items()}},
                                                   indent=1) + "\n")

    def md(head, table):
        return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *table])

    out.with_suffix(".md").write_text(
        f"# One-row GEMVs at SmolLM2-135M's shapes: {cpu}, {torch.get_num_threads()} threads\n\n"
        f"`python -m benchmarks.kernels cpu-gemv --rows {args.rows}`: weights cycled over {args.bytes / 1e6:.0f} MB "
        f"(read from memory), {args.rounds} interleaved rounds, medians. Memory in the same run (`torch.dot`): "
        f"{mem:.1f} GB/s. GB/s is the weight's bytes in its dtype over the time.\n\n"
        f"{row_counts[0]} row(s) of x:\n\n" + md(header, rows) + "\n\nBy rows of x:\n\n"
        + md(by_rows_header, by_rows_table) + "\n")


if __name__ == "__main__":
    main()
