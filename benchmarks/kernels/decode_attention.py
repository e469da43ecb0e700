"""Decode attention at the offline batch's shape, bf16 vs FP8 KV cache, over ``LaunchConfig`` variants.

The shape of a decode step of ``python -m benchmarks.offline profile`` (512 requests of 256 + up to 256
tokens on llama3-8b): ``--batch`` requests, contexts drawn uniformly from ``--min-ctx``..``--max-ctx``,
32 query heads, 8 kv heads, head_dim 128, blocks of 16 scattered over the pool. The kernels run as
CUDA-graph capture launches them (``static_decode_splits(--max-model-len)``); times are
``triton.testing.do_bench`` medians of ``attend_paged_cached`` (attention only, no store), and
GB/s divides the K/V bytes read by them. Each variant is checked against the reference first.

    python -m benchmarks.kernels decode-attention --out $OUT     # H100: under a minute
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--min-ctx", type=int, default=257)
    p.add_argument("--max-ctx", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--variants", type=int, default=len(VARIANTS), help="only the first this many variants")
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)

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
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = base.kv_cache.to(kv_dtype)
        kv_bytes = sum(ctx) * 8 * 128 * 2 * cache.element_size()
        want = attend_paged_reference(base.q, base.k[:0], base.v[:0], cache.clone(),
                                      replace(base.meta, slot_mapping=base.meta.slot_mapping[:0]), scale)
        for over in VARIANTS[:args.variants]:
            cfg = replace(LaunchConfig(), **over)
            out = torch.empty_like(base.q)
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


if __name__ == "__main__":
    main()
