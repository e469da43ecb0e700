"""What bounds SmolLM2's fp32 batch-1 decode step on the CPU: the weights' bytes or the per-op work?

For each thread count (``--threads``, default 1 and every core), one process, same weights:

    copy GB/s         a 1 GiB memcpy (read + write; larger than the last-level cache)
    read GB/s         a 1 GiB sum (read only)
    step ms           kiln's eager model forward of one decode token (``compile.mode=eager``)
    gemm ms           the step's GEMMs alone: every decoder linear and the LM head, one row each,
                      back to back on the model's own weights (F.linear, as eager runs them)
    other ms          step - gemm: norms, rotary, attention, residuals, Python
    best speed-up     step / gemm: what removing all but the GEMMs would give

The GEMMs read every weight once (540 MB in fp32), so no compile mode that keeps fp32 weights and
the GEMM kernels can make a step faster than ``gemm ms``.

    python -m benchmarks.decode cpu-bound
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import out_dir, weight_bytes_per_step


def _median_s(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _decode_step(runner):
    """A callable running the eager model on one decode token (context 16, one request)."""
    from kiln.forward_context import AttentionMetadata, ForwardContext, forward_context

    context_len, block_size = 16, runner.block_size
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([context_len - 1]), query_start_loc=torch.arange(2, dtype=torch.int32),
        seq_lens=torch.tensor([context_len], dtype=torch.int32),
        block_tables=torch.arange(-(-context_len // block_size), dtype=torch.int32)[None],
        num_decodes=1, max_query_len=1, max_seq_len=context_len, query_lens_cpu=[1], seq_lens_cpu=[context_len])
    ids, pos = torch.tensor([1234]), torch.tensor([context_len - 1])
    model = runner.model

    def step():
        ctx = ForwardContext(attn=meta, kv_caches=runner.kv_caches,
                             attention_impl=runner.compiled.kernels.attention.impl)  # as the engine runs it
        with torch.inference_mode(), forward_context(ctx):
            hidden = model(ids, pos)
            return model.compute_logits(hidden[-1:])

    return step


def _gemms(model):
    """A callable running the step's GEMMs alone, one row each, on the model's weights."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    rows = {k: torch.randn(1, k, dtype=head.dtype) for k in {m.in_features for m in linears} | {head.shape[1]}}

    def gemms():
        with torch.inference_mode():
            for m in linears:
                F.linear(rows[m.in_features], m.weight)
            F.linear(rows[head.shape[1]], head)

    return gemms


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", default=f"1,{os.cpu_count()}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each number is the best of them")
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)
    from kiln import LLM

    llm = LLM(model={"model": args.model, "dtype": "float32", "max_model_len": 1024}, compile={"mode": "eager"})
    runner = llm.engine.executor.runner
    weight_bytes = weight_bytes_per_step(runner.model)
    big = torch.ones(2**30, dtype=torch.uint8)  # written, so reads reach memory (not the zero page)
    big2 = torch.ones_like(big)
    bigf = big.view(torch.float32)
    step, gemms = _decode_step(runner), _gemms(runner.model)
    load_start = os.getloadavg()[0]
    rows = []
    for _ in range(args.rounds):  # interleaved thread counts
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            row = {"threads": threads,
                   "copy_gb_s": 2 * big.numel() / _median_s(lambda: big2.copy_(big), 5) / 1e9,
                   "read_gb_s": big.numel() / _median_s(lambda: bigf.sum(), 5) / 1e9,
                   "step_ms": 1e3 * _median_s(step, args.iters), "gemm_ms": 1e3 * _median_s(gemms, args.iters)}
            rows.append(row)
    merged = {}
    for r in rows:  # the best round per thread count (least disturbed by other jobs on a shared machine)
        m = merged.setdefault(r["threads"], dict(r))
        for k in ("step_ms", "gemm_ms"):
            m[k] = min(m[k], r[k])
        for k in ("copy_gb_s", "read_gb_s"):
            m[k] = max(m[k], r[k])
    records = []
    for m in merged.values():
        m["other_ms"] = m["step_ms"] - m["gemm_ms"]
        m["gemm_read_gb_s"] = weight_bytes / m["gemm_ms"] / 1e6
        m["best_speedup"] = m["step_ms"] / m["gemm_ms"]
        records.append({k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()})
    meta = {"model": args.model, "rounds": args.rounds, "weight_mb_per_step": weight_bytes / 1e6, "torch": torch.__version__,
            "cores": os.cpu_count(), "cpu": _cpu_model(), "load_avg_start": load_start,
            "load_avg_end": os.getloadavg()[0]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_decode_bound.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    keys = ["threads", "copy_gb_s", "read_gb_s", "step_ms", "gemm_ms", "other_ms", "gemm_read_gb_s", "best_speedup"]
    md = [f"# What bounds SmolLM2 fp32 batch-1 decode on the CPU ({meta['cpu']}, {meta['cores']} cores)", "",
          f"torch {meta['torch']}; {meta['weight_mb_per_step']:.0f} MB of fp32 weights a step; load average "
          f"{load_start:.2f} at start, {meta['load_avg_end']:.2f} at end; best of {args.rounds} interleaved rounds.", "",
          "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in records]
    (out / "cpu_decode_bound.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")


if __name__ == "__main__":
    main()
