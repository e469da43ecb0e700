"""What do per-tensor FP8 KV cache scales cost the Triton attention and store kernels?

llama3-8b's attention shapes (32 query heads, 8 kv heads, head_dim 128, blocks of 16), bf16 q/k/v:
each case is timed over a bf16 cache, an FP8 cache without scales (scale 1) and an FP8 cache with
(k_scale, v_scale) = amax / 224. Cases: decode at batch 1 (context 4096) and batch 64 (context
1024), as CUDA-graph capture launches them (``static_decode_splits``), a 2048-token prefill, and the
store of 2048 new tokens. Times are ``triton.testing.do_bench`` medians; each scaled run is checked
against the reference first (cache bit for bit, output relative error).

    python -m benchmarks.kernels fp8-kv-scales --out $OUT     # H100: well under a minute
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import out_dir

FP8 = torch.float8_e4m3fn
CASES = {"decode b1 ctx4096": ((4096,), ()), "decode b64 ctx1024": ((1024,) * 64, ()),
         "prefill 2048": ((), ((2048, 2048),))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)

    import triton

    from kiln.ops.attention import attend_paged_reference
    from kiln.ops.paged_batch import PagedBatchSpec, random_paged_batch
    from kiln.ops.triton_attention import attend_paged_cached, static_decode_splits, triton_attend_paged
    from kiln.ops.triton_kv_store import triton_store_kv

    scale, rows = 128 ** -0.5, []
    for name, (decodes, prefills) in CASES.items():
        spec = PagedBatchSpec(decode_seq_lens=decodes, prefill_chunks=prefills, num_heads=32, num_kv_heads=8,
                              head_dim=128, block_size=16, dtype=torch.bfloat16)
        b = random_paged_batch(spec, device="cuda", seed=0)
        kv_scale = torch.stack([b.k.float().abs().max(), b.v.float().abs().max()]) / 224
        for label, dtype, s in (("bf16", torch.bfloat16, None), ("fp8", FP8, None), ("fp8 scaled", FP8, kv_scale)):
            cache = b.kv_cache.to(dtype)
            err = None
            if s is not None:
                ref_cache, got_cache = cache.clone(), cache.clone()
                want = attend_paged_reference(b.q, b.k, b.v, ref_cache, b.meta, scale, kv_scale=s)
                got = triton_attend_paged(b.q, b.k, b.v, got_cache, b.meta, scale, kv_scale=s)
                assert torch.equal(ref_cache.view(torch.uint8), got_cache.view(torch.uint8)), "store differs"
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            out = torch.empty_like(b.q)
            with static_decode_splits(8192):
                ms = triton.testing.do_bench(
                    lambda: attend_paged_cached(b.q, cache, b.meta, scale, out, kv_scale=s), warmup=25, rep=200)
            row = dict(case=name, cache=label, attend_us=1e3 * ms, rel_err=err)
            if name.startswith("prefill"):
                row["store_us"] = 1e3 * triton.testing.do_bench(
                    lambda: triton_store_kv(b.k, b.v, cache, b.meta.slot_mapping, kv_scale=s), warmup=25, rep=200)
            rows.append(row)
            print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name()
    print(f"\n{device}, llama3-8b attention shapes, bf16 q/k/v\n| case | cache | attend us | store us | rel err |\n"
          "| --- | --- | --- | --- | --- |")
    for r in rows:
        store = f"{r['store_us']:.1f}" if "store_us" in r else ""
        err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else ""
        print(f"| {r['case']} | {r['cache']} | {r['attend_us']:.1f} | {store} | {err} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_kv_scales.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
