"""Decode attention at the offline batch's shape, bf16 vs FP8 KV cache, over ``LaunchConfig`` variants.

The shape of a decode step of ``python -m benchmarks.offline profile`` (512 requests of 256 + up to 256
tokens on llama3-8b): ``--batch`` requests, contexts drawn uniformly from ``--min-ctx``..``--max-ctx``,
32 query heads, 8 kv heads, head_dim 128, blocks of 16 scattered over the pool. The kernels run as
CUDA-graph capture launches them (``static_decode_splits(--max-model-len)``); times are
``triton.testing.do_bench`` medians of ``attend_paged_cached`` (attention only, no store), and
GB/s divides the K/V bytes read by them. Each variant is checked against the reference first.
A variant overrides ``LaunchConfig`` fields: ``VARIANTS`` for a bf16 cache, ``FP8_VARIANTS`` (the
register cap of ``kiln.ops.triton_attention.decode_maxnreg``) for an FP8 one.

``--ops``: instead, the op a decode-only step of the Llama family calls per layer
(``triton_attend_paged_rope``: q and k not yet rotated, the new K/V not yet stored) at each
``--batches`` size, with the store and rotary joined into the decode kernel or in launches of their
own (``kernels.max_store_join_pairs``), in a pool of just the batch's blocks and in one of ``--pool-blocks``
(the engine's cache of one layer: its blocks scattered over it), beside attention alone.

    python -m benchmarks.kernels decode-attention --out $OUT     # H100: under a minute
    python -m benchmarks.kernels decode-attention --ops --batches 64,256,512 --out $OUT
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks.common import out_dir

VARIANTS = [dict(), dict(decode_block_n=128), dict(decode_block_n=32), dict(decode_num_warps=8),
            dict(decode_num_warps=8, decode_block_n=128), dict(decode_num_stages=2), dict(decode_num_stages=4)]
FP8_VARIANTS = [dict(), dict(fp8_decode_maxnreg=None), dict(fp8_decode_maxnreg=128), dict(fp8_decode_maxnreg=80),
                dict(decode_block_n=128), dict(decode_num_stages=5)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--min-ctx", type=int, default=257)
    p.add_argument("--max-ctx", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--variants", type=int, default=None, help="only the first this many variants")
    p.add_argument("--kv", default="bfloat16,float8_e4m3fn", help="','-separated cache dtypes")
    p.add_argument("--ops", action="store_true", help="time the per-layer op of a decode step (see above)")
    p.add_argument("--batches", default="512", help="--ops: ','-separated decode batch sizes")
    p.add_argument("--pool-blocks", type=int, default=53248, help="--ops: blocks of the large pool")
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)
    if args.ops:
        return ops(args)

    import triton

    from kiln.ops.attention import attend_paged_reference
    from kiln.ops.paged_batch import PagedBatchSpec, random_paged_batch
    from kiln.ops.triton_attention import LaunchConfig, attend_paged_cached, static_decode_splits

    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(args.min_ctx, args.max_ctx + 1, (args.batch,), generator=gen).tolist()
    spec = PagedBatchSpec(decode_seq_lens=tuple(ctx), num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                          dtype=torch.bfloat16)
    base = random_paged_batch(spec, device="cuda", seed=0)
    scale = 128 ** -0.5
    rows = []
    for kv_dtype in (getattr(torch, name) for name in args.kv.split(",")):
        cache = base.kv_cache.to(kv_dtype)
        kv_bytes = sum(ctx) * 8 * 128 * 2 * cache.element_size()
        want = attend_paged_reference(base.q, base.k[:0], base.v[:0], cache.clone(),
                                      replace(base.meta, slot_mapping=base.meta.slot_mapping[:0]), scale)
        for over in (FP8_VARIANTS if cache.element_size() == 1 else VARIANTS)[:args.variants]:
            cfg = replace(LaunchConfig(), **over)
            out = torch.full_like(base.q, float("nan"))
            with static_decode_splits(args.max_model_len):
                attend_paged_cached(base.q, cache, base.meta, scale, out, cfg)
                err = (out.float() - want.float()).abs().max().item()
                ms = triton.testing.do_bench(lambda: attend_paged_cached(base.q, cache, base.meta, scale, out, cfg),
                                             warmup=25, rep=200)
            row = {"kv": str(kv_dtype).removeprefix("torch."), "variant": over, "us": 1e3 * ms,
                   "gb_s": kv_bytes / (ms * 1e-3) / 1e9, "max_err": err, "config": asdict(cfg)}
            rows.append(row)
            print(f"{row['kv']:14s} {json.dumps(over):60s} {row['us']:8.1f} us {row['gb_s']:7.0f} GB/s  err {err:.3g}",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_attention_offline.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "batch": args.batch, "ctx": [args.min_ctx, args.max_ctx],
         "rows": rows}, indent=1))


def ops(args) -> None:
    import time

    import triton

    from kiln.ops.options import kernel_options
    from kiln.ops.paged_batch import PagedBatchSpec, random_paged_batch
    from kiln.ops.triton_attention import (attend_paged_cached, random_rotary, static_decode_splits,
                                           triton_attend_paged_rope)

    rows = []
    scale = 128 ** -0.5
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke run under TRITON_INTERPRET=1

    def bench(fn):
        if dev == "cuda":
            return triton.testing.do_bench(fn, warmup=25, rep=200)
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)

    for batch in (int(b) for b in args.batches.split(",") if b):
        gen = torch.Generator().manual_seed(0)
        ctx = torch.randint(args.min_ctx, args.max_ctx + 1, (batch,), generator=gen).tolist()
        spec = PagedBatchSpec(decode_seq_lens=tuple(ctx), num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                              dtype=torch.bfloat16)
        b = random_paged_batch(spec, device=dev, seed=0)
        cos, sin = random_rotary(batch, 128, torch.bfloat16, dev)
        kv_bytes = sum(ctx) * 8 * 128 * 2 * 2
        pools = {"batch's blocks": (b.kv_cache, b.meta)}
        if args.pool_blocks > b.kv_cache.shape[1]:
            remap = torch.randperm(args.pool_blocks, device=dev)[:b.kv_cache.shape[1]]
            big = torch.empty((2, args.pool_blocks, *b.kv_cache.shape[2:]), dtype=b.kv_cache.dtype, device=dev)
            big[:, remap] = b.kv_cache
            slots = b.meta.slot_mapping
            meta = replace(b.meta, block_tables=remap[b.meta.block_tables.long()].to(torch.int32),
                           slot_mapping=remap[slots // 16] * 16 + slots % 16)
            pools[f"{args.pool_blocks} blocks"] = (big, meta)
        for pool, (cache, meta) in pools.items():
            variants = {
                "attention alone": lambda: attend_paged_cached(b.q, cache, meta, scale, out),
                "op, store + rotary joined": lambda: triton_attend_paged_rope(b.q, b.k, b.v, cos, sin, cache, meta,
                                                                             scale),
                "op, store + rotary apart": lambda: triton_attend_paged_rope(b.q, b.k, b.v, cos, sin, cache, meta,
                                                                            scale),
            }
            for name, fn in variants.items():
                out = torch.empty_like(b.q)
                pairs = 0 if "apart" in name else 1 << 30  # joined at every batch size, or never
                with kernel_options(max_store_join_pairs=pairs), static_decode_splits(args.max_model_len):
                    fn()
                    ms = bench(fn)
                row = {"batch": batch, "pool": pool, "variant": name, "us": 1e3 * ms,
                       "gb_s": kv_bytes / (ms * 1e-3) / 1e9, "mean_ctx": sum(ctx) / batch}
                rows.append(row)
                print(f"batch {batch:4d}  {pool:16s} {name:28s} {row['us']:8.1f} us {row['gb_s']:7.0f} GB/s",
                      flush=True)
        del pools, b
        torch.cuda.empty_cache()
    out_path = Path(args.out)
    out_path.mkdir(parents=True, exist_ok=True)
    (out_path / "decode_attention_ops.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "ctx": [args.min_ctx, args.max_ctx],
         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
