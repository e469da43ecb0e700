"""Benchmark the Triton paged-attention kernels against the pure-torch reference (CUDA only).

    python -m benchmarks.kernels attention            # benchmark
    python -m benchmarks.kernels attention --check    # correctness first, then benchmark
    python -m benchmarks.kernels attention --check-only
    python -m benchmarks.kernels attention --sweep        # try LaunchConfig variants

Shapes are llama3-8b's (32 query heads, 8 kv heads, head_dim 128, bf16, block size 16). Decode:
batch 1/32/256 x context 128..4096; prefill: chunks with and without a cached prefix. Times are
``triton.testing.do_bench`` medians of:

    triton   store + attend (``triton_attend_paged``, what the model calls)
    attend   attention kernels only (``attend_paged_cached``)
    graph    ``attend`` replayed from a CUDA graph: the kernels without Python launch overhead
    torch    the reference (``attend_paged_reference``), store + attend

KV GB/s (decode's HBM bandwidth) and TFLOP/s divide the K/V bytes read and the causal flops by the
faster of ``attend`` and ``graph``.

Results go to ``$OUT/attention_kernels.json``; the
last thing printed is a short table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace

import torch

from benchmarks.common import out_dir

H, KVH, D, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
DECODE_BATCHES = (1, 32, 256)
DECODE_CONTEXTS = (128, 512, 1024, 2048, 4096)
PREFILLS = {  # name: (seq_len, query_len) per request
    "fresh 2048": ((2048, 2048),),
    "prefix 3584 + 512": ((4096, 512),),
    "4 x fresh 1024": ((1024, 1024),) * 4,
}


# LaunchConfig variants for --sweep (fields not named keep their defaults).
DECODE_SWEEP = [dict(), dict(decode_block_n=32), dict(decode_block_n=128), dict(decode_num_warps=8),
                dict(min_split_tokens=128), dict(min_split_tokens=512), dict(programs_per_sm=4),
                dict(decode_num_stages=2), dict(decode_num_stages=4), dict(decode_block_n=128, decode_num_stages=2)]
PREFILL_SWEEP = [dict(), dict(prefill_num_stages=3), dict(prefill_block_m=128, prefill_num_warps=8),
                 dict(prefill_block_m=128, prefill_num_warps=8, prefill_num_stages=3),
                 dict(prefill_block_m=128, prefill_block_n=32), dict(prefill_block_n=32, prefill_num_stages=3),
                 dict(prefill_block_m=128, prefill_block_n=128, prefill_num_warps=8), dict(prefill_block_n=128)]


def log(msg: str) -> None:
    print(msg, flush=True)


def run_checks(k) -> None:
    """The kernels vs the reference at realistic shapes; raises on the first mismatch."""
    cases = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cases.append((dict(decode_seq_lens=(4096, 1, 300, 2049), dtype=dtype), "decode split-K"))
        cases.append((dict(decode_seq_lens=(17, 250, 3000), prefill_chunks=((4000, 333), (700, 700), (90, 1)),
                           dtype=dtype), "mixed"))
    cases.append((dict(decode_seq_lens=tuple(range(100, 4097, 16))), "decode batch 250"))
    for heads, kv_heads, head_dim in ((32, 32, 128), (32, 8, 64), (64, 8, 128), (28, 4, 128)):
        for block_size in (16, 32):
            cases.append((dict(decode_seq_lens=(1000, 33), prefill_chunks=((1500, 600), (257, 257)), num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size),
                          f"H{heads}/KVH{kv_heads}/D{head_dim}/bs{block_size}"))
    for i, (kw, name) in enumerate(cases):
        kw.setdefault("num_heads", H)
        kw.setdefault("num_kv_heads", KVH)
        kw.setdefault("head_dim", D)
        kw.setdefault("dtype", DTYPE)
        spec = k.PagedBatchSpec(**kw)
        err = k.check_against_reference(k.random_paged_batch(spec, "cuda", seed=i))
        log(f"check ok  {name:<24} {str(spec.dtype):<15} max abs err {err:.2e}")
        torch.cuda.empty_cache()


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph_ms(fn) -> float | None:
    import triton.testing

    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # graphs are a bonus column; never lose the run over them
        log(f"  (cuda graph timing failed: {type(e).__name__}: {e})")
        return None


def bench_case(k, name: str, spec, flops: float) -> dict:
    from kiln.ops.attention import attend_paged_reference

    b = k.random_paged_batch(spec, "cuda", seed=0)
    scale = spec.head_dim**-0.5
    out = torch.empty_like(b.q)
    kv_bytes = sum(b.meta.seq_lens_cpu) * spec.num_kv_heads * spec.head_dim * 2 * b.kv_cache.element_size()
    row = dict(case=name, num_reqs=b.meta.num_reqs, max_seq_len=b.meta.max_seq_len, num_tokens=b.q.shape[0],
               kv_bytes=kv_bytes, flops=flops)
    row["triton_ms"] = bench_ms(lambda: k.triton_attend_paged(b.q, b.k, b.v, b.kv_cache, b.meta, scale))
    row["attend_ms"] = bench_ms(lambda: k.attend_paged_cached(b.q, b.kv_cache, b.meta, scale, out))
    row["graph_ms"] = bench_graph_ms(lambda: k.attend_paged_cached(b.q, b.kv_cache, b.meta, scale, out))
    try:
        row["torch_ms"] = bench_ms(lambda: attend_paged_reference(b.q, b.k, b.v, b.kv_cache, b.meta, scale))
    except torch.OutOfMemoryError:
        row["torch_ms"] = None
    best = min(t for t in (row["attend_ms"], row["graph_ms"]) if t)
    row["kv_gbps"] = kv_bytes / best / 1e6
    row["tflops"] = flops / best / 1e9
    return row


def causal_flops(chunks, heads: int, head_dim: int) -> float:
    """QK^T and PV: 4 * head_dim flops per (query, visible key) pair per head."""
    pairs = sum(sum(range(s - q + 1, s + 1)) for s, q in chunks)
    return 4.0 * head_dim * heads * pairs


def run_benchmarks(k) -> list[dict]:
    rows = []
    cases = [(f"decode b{b} ctx{c}", _spec(k, decodes=(c,) * b), causal_flops([(c, 1)] * b, H, D))
             for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    cases += [(f"prefill {name}", _spec(k, prefills=chunks), causal_flops(chunks, H, D))
              for name, chunks in PREFILLS.items()]
    for name, spec, flops in cases:
        try:
            row = bench_case(k, name, spec, flops)
        except Exception as e:  # keep going: one bad case must not lose the others
            row = dict(case=name, error=f"{type(e).__name__}: {e}")
        torch.cuda.empty_cache()  # the case's batch is gone with bench_case's frame
        log(json.dumps(row))
        rows.append(row)
    return rows


def _spec(k, decodes=(), prefills=()):
    return k.PagedBatchSpec(decode_seq_lens=decodes, prefill_chunks=prefills, num_heads=H, num_kv_heads=KVH,
                            head_dim=D, block_size=BLOCK_SIZE, dtype=DTYPE)


def run_sweep(k) -> list[dict]:
    """Attention-only time (CUDA graph) of each LaunchConfig variant; each is checked first."""
    phases = [
        (DECODE_SWEEP, {f"decode b{b} ctx{c}": _spec(k, decodes=(c,) * b)
                        for b, c in ((1, 4096), (32, 1024), (256, 2048))}),
        (PREFILL_SWEEP, {f"prefill {n}": _spec(k, prefills=PREFILLS[n]) for n in ("fresh 2048", "prefix 3584 + 512")}),
    ]
    check_batch = k.random_paged_batch(_spec(k, decodes=(3000, 40), prefills=((2000, 700), (300, 300))), "cuda", seed=9)
    rows = []
    for variants, cases in phases:
        cfgs = [replace(k.LaunchConfig(), **v) for v in variants]
        for cfg in cfgs:
            k.check_against_reference(check_batch, cfg)
        for name, spec in cases.items():
            b = k.random_paged_batch(spec, "cuda", seed=0)
            out, scale = torch.empty_like(b.q), D**-0.5
            for variant, cfg in zip(variants, cfgs):
                ms = bench_graph_ms(lambda: k.attend_paged_cached(b.q, b.kv_cache, b.meta, scale, out, cfg))
                rows.append(dict(case=name, variant=variant, graph_ms=ms))
                log(json.dumps(rows[-1]))
    log(f"\n{'case':<28}{'default ms':>11}{'best ms':>9}  best variant")
    for name in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == name and r["graph_ms"]]
        best = min(mine, key=lambda r: r["graph_ms"])
        log(f"{name:<28}{_fmt(mine[0]['graph_ms']):>11}{_fmt(best['graph_ms']):>9}  {best['variant'] or 'default'}")
    return rows


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    log(f"\n{'case':<28}{'triton ms':>10}{'attend ms':>10}{'graph ms':>10}{'torch ms':>10}{'speedup':>9}"
        f"{'KV GB/s':>9}{'TFLOP/s':>9}")
    for r in rows:
        if "error" in r:
            log(f"{r['case']:<28}  ERROR {r['error'][:80]}")
            continue
        speedup = r["torch_ms"] / r["triton_ms"] if r["torch_ms"] else None
        log(f"{r['case']:<28}{_fmt(r['triton_ms']):>10}{_fmt(r['attend_ms']):>10}{_fmt(r['graph_ms']):>10}"
            f"{_fmt(r['torch_ms']):>10}{_fmt(speedup, '.1f'):>9}{_fmt(r['kv_gbps'], '.0f'):>9}"
            f"{_fmt(r['tflops'], '.1f'):>9}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="run the correctness checks first")
    parser.add_argument("--check-only", action="store_true", help="run the correctness checks and stop")
    parser.add_argument("--sweep", action="store_true", help="time LaunchConfig variants instead of the benchmark")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        log("attention_kernels: needs CUDA (the CPU path is tests/ops/test_triton_attention.py)")
        return 2
    import triton

    from kiln.ops import triton_attention as k

    device = torch.cuda.get_device_name()
    log(f"device {device}, torch {torch.__version__}, triton {triton.__version__}, {k.LaunchConfig()}")
    if args.check or args.check_only:
        t0 = time.time()
        run_checks(k)
        log(f"all checks passed in {time.time() - t0:.0f} s")
        if args.check_only:
            return 0
    rows = run_sweep(k) if args.sweep else run_benchmarks(k)
    out = out_dir()
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                  launch_config=asdict(k.LaunchConfig()), shapes=dict(num_heads=H, num_kv_heads=KVH, head_dim=D,
                  block_size=BLOCK_SIZE, dtype=str(DTYPE)), rows=rows)
    path = out / ("attention_sweep.json" if args.sweep else "attention_kernels.json")
    path.write_text(json.dumps(result, indent=1))
    log(f"wrote {path}")
    if not args.sweep:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
