"""The joined ops at batch-1 decode per llama3-8b site: norm / activation + GEMV, apart and joined.

For dense (bf16), fp8 (per-channel scales, read as W8A16) and int4 (group 32) weights, each site a
joined op serves (qkv and gate_up fed by the add + RMSNorm, down by SiLU-and-mul):

- apart: the ``kiln_triton`` norm or activation kernel, then the one-row GEMV (two kernels, PDL as
  served; what ``kernels.gemv_join=[]`` serves, for fp8 inside ``kiln_triton``'s joined op);
- joined: ``kiln_cuda::<feed>_linear_<scheme>`` (one fed GEMV) with the tile ``config_for`` picks;
- with ``--sweep``: the fed GEMV over a few tiles, the best kept. Best tiles 3% or more faster than
  the served one are written as ``best`` ("<scheme>+<feed>,1,N,K": tile), which
  ``decode_profile.py --gemm-configs`` loads for an end-to-end run and which belong in
  ``kiln.ops.triton_quant_gemm.MEASURED`` once confirmed there.

Each time is one call replayed from a CUDA graph cycling through enough weight copies to defeat
the L2 cache (``quant_gemm.graph_time``). Writes ``<out>/gemv_join.json`` and prints a table.

    python -m benchmarks.kernels gemv-join --sweep --out $OUT     # about a minute a scheme
    python -m benchmarks.kernels gemv-join --schemes fp8 --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from benchmarks.common import console_table, device_name, out_dir
from benchmarks.kernels.quant_gemm import GROUP, graph_time

SITES = {"qkv": ("norm", 6144, 4096), "gate_up": ("norm", 28672, 4096), "down": ("silu", 4096, 14336)}
COPY_BYTES = 512 << 20  # weight copies cycled per timing: well past the L2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default="dense,fp8,int4")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--deadline-s", type=float, default=200.0)
    p.add_argument("--out", default=str(out_dir()))
    return p.parse_args(argv)


def sweep_tiles(scheme: str):
    from kiln.ops.triton_quant_gemm import GemmConfig

    if scheme == "dense":
        shapes = [(4, 512, 2), (8, 512, 4), (8, 1024, 8), (16, 512, 4), (16, 1024, 8), (32, 256, 4), (8, 256, 2)]
        return [GemmConfig(1, bn, bk, 1, nw, ns) for bn, bk, nw in shapes for ns in (3, 4)]
    if scheme == "fp8":
        shapes = [(8, 512, 2), (8, 1024, 4), (16, 512, 4), (16, 1024, 4), (16, 1024, 8), (32, 512, 4), (8, 256, 2)]
        return [GemmConfig(1, bn, bk, 1, nw, ns) for bn, bk, nw in shapes for ns in (3, 4)]
    shapes = [(8, 2048, 4), (8, 1024, 2), (16, 1024, 4), (16, 2048, 8), (32, 1024, 8), (32, 512, 4)]
    return [GemmConfig(1, bn, bk, 1, nw, 1) for bn, bk, nw in shapes]


def _weights(scheme: str, n: int, k: int, copies: int):
    from kiln.ops import quant

    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda") * 0.02
        if scheme == "dense":
            out.append((w.bfloat16(), None))
        elif scheme == "fp8":
            out.append((*quant.quantize_fp8(w), torch.bfloat16))  # (w, scales, the output dtype)
        else:
            out.append((*quant.quantize_int4(w, GROUP, torch.bfloat16), GROUP))
    return out


def time_site(scheme: str, site: str, sweep: bool) -> dict:
    from kiln.ops import triton_joined_linear as tj
    from kiln.ops.triton_norm import triton_add_rms_norm, triton_silu_and_mul
    from kiln.ops.triton_quant_gemm import GemvFeed, config_for, triton_linear

    kind, n, k = SITES[site]
    bytes_per_copy = n * k * {"dense": 2, "fp8": 1, "int4": 0.5}[scheme]
    copies = max(2, int(COPY_BYTES // bytes_per_copy))
    weights = _weights(scheme, n, k, copies)
    x, res = (torch.randn(1, k, device="cuda").bfloat16() for _ in range(2))
    gamma = (torch.rand(k, device="cuda") + 0.5).bfloat16()
    gate_up = torch.randn(1, 2 * k, device="cuda").bfloat16()
    joined = getattr(torch.ops.kiln_cuda, f"{'add_rms_norm' if kind == 'norm' else 'silu_and_mul'}_linear_{scheme}")
    assert tj.fuses(scheme, kind, x if kind == "norm" else gate_up, weights[0], gamma.dtype), "served apart"

    gemm = tj._unfused_gemm  # the GEMM op's own function: the one-row GEMV
    if kind == "norm":
        apart = lambda i: gemm(scheme, triton_add_rms_norm(x, res, gamma, 1e-5)[0], weights[i])  # noqa: E731
        fused = lambda i: joined(x, res, gamma, 1e-5, *weights[i])  # noqa: E731
    else:
        apart = lambda i: gemm(scheme, triton_silu_and_mul(gate_up), weights[i])  # noqa: E731
        fused = lambda i: joined(gate_up, *weights[i])  # noqa: E731
    row = {"scheme": scheme, "site": site, "feed": kind, "n": n, "k": k,
           "served_tile": list(dataclasses.astuple(config_for(scheme, 1, n, k, GROUP, kind))),
           "apart_us": 1e6 * graph_time(apart, copies), "joined_us": 1e6 * graph_time(fused, copies)}
    if sweep:
        new_res = torch.empty_like(x)
        feed = GemvFeed("norm", res, gamma, 1e-5, new_res) if kind == "norm" else GemvFeed("silu")
        a = x if kind == "norm" else gate_up

        def fed(a, gemm_args, feed, cfg):  # the fed GEMV with tile cfg
            w, scales, group_size, _, out_dtype = tj.split_gemm_args(scheme, gemm_args)
            return triton_linear(scheme, a, w, scales, group_size, feed=feed, config=cfg, out_dtype=out_dtype)

        best = (float("inf"), None)
        for cfg in sweep_tiles(scheme):
            try:
                t = graph_time(lambda i: fed(a, weights[i], feed, cfg), copies, reps=3)
            except Exception as e:  # noqa: BLE001  (a tile this kernel cannot compile: skipped)
                print(f"{scheme} {site} {cfg}: {type(e).__name__}", flush=True)
                continue
            best = min(best, (t, cfg), key=lambda b: b[0])
        if best[1] is not None:
            row["best_us"], row["best_tile"] = 1e6 * best[0], list(dataclasses.astuple(best[1]))
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for scheme in args.schemes.split(","):
        for site in SITES:
            if time.perf_counter() - t0 > args.deadline_s:
                print(f"deadline: {scheme} {site} not run", flush=True)
                continue
            rows.append(time_site(scheme, site, args.sweep))
            print(rows[-1], flush=True)
    table = console_table(["scheme", "site", "apart us", "joined us", "best fed us", "served tile", "best tile"],
                          [[r["scheme"], r["site"], f"{r['apart_us']:.2f}", f"{r['joined_us']:.2f}",
                            f"{r.get('best_us', float('nan')):.2f}", r["served_tile"], r.get("best_tile", "")]
                           for r in rows])
    print(f"{device_name()}, batch 1, bf16 activations, llama3-8b shapes\n{table}", flush=True)
    # Swept tiles that beat the served one, as ``load_measured`` (and decode_profile --gemm-configs) reads them.
    best = {f"{r['scheme']}+{r['feed']},1,{r['n']},{r['k']}": r["best_tile"] for r in rows
            if r.get("best_us", float("inf")) < 0.97 * r["joined_us"]}
    print(f"fed tiles to load: {best}", flush=True)
    (out / "gemv_join.json").write_text(json.dumps({"device": device_name(), "rows": rows, "best": best}, indent=1))


if __name__ == "__main__":
    main()
