"""Benchmark the C++ CPU paged-attention kernel against the pure-torch reference.

    python -m benchmarks.kernels cpu-attention                  # float32 and bfloat16, torch's thread count
    python -m benchmarks.kernels cpu-attention --threads 1 --check
    python -m benchmarks.kernels cpu-attention --dtypes float32
    python -m benchmarks.kernels cpu-attention --fp8-cache      # also each dtype over an FP8 (e4m3) cache

Shapes are SmolLM2-135M's (9 query heads, 3 kv heads, head_dim 64, block size 16): decode batch
1 and 32 at context 160 and 1024, a fresh 128-token prefill, and a 128-token chunk after a
896-token cached prefix. Each time is the median of ``--reps`` calls of store + attend, as the model
calls them (``cpu_attend_paged`` vs ``attend_paged_reference``), q/k/v as strided views of one
fused qkv tensor. KV GB/s divides the K/V bytes the kernel reads by its time.

Other processes may share the CPU: the thread count and the load average are saved with the
numbers. On a loaded machine use ``--threads 1``: with more threads than free cores every
parallel region waits for its slowest, descheduled thread.
Results go to ``$OUT/cpu-attention.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import console_table, device_name, out_dir

from kiln.ops import cpu_attention as ca
from kiln.ops.attention import attend_paged_reference

H, KVH, D, BLOCK_SIZE = 9, 3, 64, 16
CASES = {  # name: (decode seq_lens, prefill (seq_len, query_len) chunks)
    "decode b1 ctx160": ((160,), ()),
    "decode b1 ctx1024": ((1024,), ()),
    "decode b32 ctx160": ((160,) * 32, ()),
    "decode b32 ctx1024": ((1024,) * 32, ()),
    "prefill 128": ((), ((128, 128),)),
    "prefill 896 + 128": ((), ((1024, 128),)),
}


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_case(name: str, decodes, prefills, dtype: torch.dtype, reps: int, fp8_cache: bool = False) -> dict:
    spec = ca.PagedBatchSpec(decode_seq_lens=decodes, prefill_chunks=prefills, num_heads=H, num_kv_heads=KVH,
                             head_dim=D, block_size=BLOCK_SIZE, dtype=dtype)
    b = ca.random_paged_batch(spec, seed=0)
    s = torch.tensor([0.5, 0.25]) if fp8_cache else None  # FP8 cache: k_scale, v_scale
    if fp8_cache:
        b.kv_cache = b.kv_cache.to(torch.float8_e4m3fn)
    scale = D**-0.5
    kv_bytes = sum(b.meta.seq_lens_cpu) * KVH * D * 2 * b.kv_cache.element_size()
    kernel_ms = median_ms(lambda: ca.cpu_attend_paged(b.q, b.k, b.v, b.kv_cache, b.meta, scale, kv_scale=s), reps)
    torch_ms = median_ms(lambda: attend_paged_reference(b.q, b.k, b.v, b.kv_cache, b.meta, scale, kv_scale=s), reps)
    return dict(case=name, dtype=str(dtype).removeprefix("torch.") + ("/fp8 cache" if fp8_cache else ""),
                num_tokens=b.q.shape[0], kv_bytes=kv_bytes,
                kernel_ms=kernel_ms, torch_ms=torch_ms, speedup=torch_ms / kernel_ms,
                kv_gbps=kv_bytes / kernel_ms / 1e6)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--check", action="store_true", help="check every case against the reference first")
    parser.add_argument("--fp8-cache", action="store_true", help="also time each dtype over an FP8 cache")
    parser.add_argument("--out", type=Path, default=out_dir() / "cpu-attention.json")
    args = parser.parse_args(argv)
    if not ca.load_extension():
        print("cpu_attention: kiln._C is not built (pip install --no-build-isolation -e .)")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    print(f"{device_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if args.check:
        for dtype in dtypes:
            for i, (name, (decodes, prefills)) in enumerate(CASES.items()):
                spec = ca.PagedBatchSpec(decode_seq_lens=decodes, prefill_chunks=prefills, num_heads=H,
                                         num_kv_heads=KVH, head_dim=D, block_size=BLOCK_SIZE, dtype=dtype)
                err = ca.check_against_reference(ca.random_paged_batch(spec, seed=i))
                print(f"check ok  {name:<20} {str(dtype):<15} max abs err {err:.2e}", flush=True)
    rows = [bench_case(name, decodes, prefills, dtype, args.reps, fp8)
            for dtype in dtypes for fp8 in ((False, True) if args.fp8_cache else (False,))
            for name, (decodes, prefills) in CASES.items()]
    # The load average says how much of the machine others were using while this ran.
    result = dict(device=device_name(), torch=torch.__version__, threads=torch.get_num_threads(),
                  load_avg_1min=os.getloadavg()[0],
                  shapes=dict(num_heads=H, num_kv_heads=KVH, head_dim=D, block_size=BLOCK_SIZE), reps=args.reps,
                  rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}\n")
    print(console_table(["case", "dtype", "kernel ms", "torch ms", "speedup", "KV GB/s"],
                        [[r["case"], r["dtype"], r["kernel_ms"], r["torch_ms"], r["speedup"], r["kv_gbps"]]
                         for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
