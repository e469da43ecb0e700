"""Quantized GEMM kernels per llama3-8b linear shape at decode row counts, against torch's.

For each linear (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) and row count M:

- torch: bf16 ``F.linear``; fp8 per-token activation quantization + ``torch._scaled_mm`` (kiln's
  large-M FP8 path); int4 ``aten._weight_int4pack_mm`` (tinygemm, group 32);
- kiln's Triton weight-only kernels (``kiln.ops.triton_quant_gemm``): fp8 and int4 (group 32), every
  tile configuration of a small sweep (``--sweep``), else the configuration ``config_for`` picks.

Each time is one call replayed from a CUDA graph that cycles through enough weight copies to
defeat the L2 cache, so it is the kernel's time, not the launch's. Percent of copy bandwidth:
bytes the call reads (weight + scales at their stored size) per second over the device-to-device
copy bandwidth (bytes read + written per second). Writes ``<out>/quant_gemm.json`` (with the best
configuration per (scheme, M, N, K), the table ``kiln.ops.triton_quant_gemm.MEASURED`` holds) and
``quant_gemm.md``.

    python -m benchmarks.kernels quant-gemm --sweep --out $OUT     # H100, about 2 minutes
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import console_table, copy_bandwidth, device_name, out_dir

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
EXTRA_SHAPES = {"lm_head": (128256, 4096)}  # timed when named in --shapes
GROUP = 32


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,16,32,64")
    p.add_argument("--sweep", action="store_true", help="time every tile configuration of the sweep")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    p.add_argument("--schemes", default="fp8,int4", help="Triton kernels to time (and sweep)")
    p.add_argument("--deadline-s", type=float, default=150.0)
    p.add_argument("--out", default=str(out_dir()))
    return p.parse_args(argv)


def graph_time(fn, copies: int, reps: int = 5) -> float:
    """Seconds per call of ``fn(i)`` (i cycles over the weight copies), replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up (compiles) outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    calls = max(copies, 24)
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    del graph
    return best


def sweep_configs(scheme: str, m: int):
    """(block_m, block_n, block_k, num_warps, num_stages) x split-K per scheme and row bucket."""
    from kiln.ops.triton_quant_gemm import GemmConfig

    if m == 1 and scheme == "dense":  # bf16 weights: twice fp8's bytes a row
        tiles = [(1, bn, bk, nw, ns) for bn, bk, nw in [(8, 512, 4), (4, 1024, 4), (8, 256, 2), (16, 256, 4),
                                                        (4, 512, 2), (8, 1024, 8), (2, 1024, 2)] for ns in (2, 3, 4)]
        splits = (1,)
    elif m == 1 and scheme == "fp8":  # num_stages > 1 pipelines the weight loads through shared memory
        tiles = [(1, bn, bk, nw, ns) for bn, bk, nw in [(8, 512, 2), (4, 1024, 2), (8, 1024, 4), (16, 512, 4),
                                                        (8, 1024, 2), (4, 2048, 4)] for ns in (1, 2, 3, 4)]
        splits = (1,)
    elif m == 1:  # the word-wise GEMV
        tiles = [(1, bn, bk, nw, ns) for bn, bk, nw in [
            (32, 256, 2), (64, 256, 4), (64, 512, 8), (16, 1024, 4), (32, 256, 4), (64, 128, 4), (16, 512, 4),
            (128, 256, 8)] for ns in (1, 3)]
        splits = (1, 4)
    elif scheme == "int4":  # the tensor-core kernel, rows padded to 16
        bm = max(16, 1 << (m - 1).bit_length())
        tiles = [(bm, bn, bk, nw, 3) for bn, bk, nw in [(64, 256, 4), (64, 512, 4), (128, 256, 4), (128, 256, 8),
                                                        (32, 256, 4)]]
        splits = (1, 2, 4)
    else:
        bm = max(16, 1 << (m - 1).bit_length())
        tiles = [(bm, bn, bk, 4, 3) for bn, bk in [(32, 128), (64, 128), (128, 128), (32, 256)]]
        splits = (1, 4, 8)
    for (bm, bn, bk, nw, ns), split in itertools.product(tiles, splits):
        yield GemmConfig(bm, bn, bk, split, num_warps=nw, num_stages=ns)


def main(argv=None) -> None:
    args = parse_args(argv)
    from kiln.ops import quant
    from kiln.ops.quant_cuda import linear_fp8_cuda, linear_int4_triton, pack_int4_cuda
    from kiln.ops.triton_quant_gemm import config_for, triton_linear

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bandwidth = copy_bandwidth()
    rows_list = [int(r) for r in args.rows.split(",")]
    records, best = [], {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in {**SHAPES, **EXTRA_SHAPES}.items():
        if name not in args.shapes.split(","):
            continue
        w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
        copies = max(2, -(-(160 << 20) // (n * k * 2)))  # bf16 copies past the 50 MB L2 twice over
        bf16 = [w.clone() for _ in range(copies)]
        q8, s8 = quant.quantize_fp8(w)
        fp8 = [(q8.clone(), s8.clone()) for _ in range(max(2, copies * 2))]
        q4, sz4 = quant.quantize_int4(w, GROUP, torch.bfloat16)
        int4 = [(q4.clone(), sz4.clone()) for _ in range(max(2, copies * 3))]
        tiny = [pack_int4_cuda(q4, sz4, GROUP) for _ in range(max(2, copies * 3))]
        bytes_ = {"bf16": n * k * 2, "fp8": n * k + 4 * n, "int4": n * k // 2 + (k // GROUP) * n * 4,
                  "dense": n * k * 2}
        for m in rows_list:
            if time.perf_counter() - t0 > args.deadline_s:
                print(f"deadline: {name} M={m} not run", flush=True)
                continue
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)

            def add(system, seconds, nbytes, config=None):
                rec = {"shape": name, "n": n, "k": k, "m": m, "system": system, "us": seconds * 1e6,
                       "gb_s": nbytes / seconds / 1e9, "copy_bw_pct": 100 * nbytes / seconds / bandwidth,
                       "config": None if config is None else list(config.__dict__.values())}
                records.append(rec)
                return rec

            add("torch bf16 linear", graph_time(lambda i: F.linear(x, bf16[i]), len(bf16)), bytes_["bf16"])
            add("torch fp8 quant+_scaled_mm",
                graph_time(lambda i: _linear_fp8_scaled_mm_large(x, *fp8[i]), len(fp8)), bytes_["fp8"])
            add("torch int4 tinygemm",
                graph_time(lambda i: torch.ops.aten._weight_int4pack_mm(x, tiny[i][0], GROUP, tiny[i][1]), len(tiny)),
                bytes_["int4"])
            add("kiln op fp8 (kiln_cuda::linear_fp8)",
                graph_time(lambda i: linear_fp8_cuda(x, *fp8[i], -1), len(fp8)), bytes_["fp8"])
            add("kiln op int4 (kiln_cuda::linear_int4_triton)",
                graph_time(lambda i: linear_int4_triton(x, *int4[i], GROUP), len(int4)), bytes_["int4"])
            if m not in (1, 16):
                # Above the op's Triton row limit: the int4 tensor-core tile against the op's dequant + cuBLAS.
                cfg = config_for("int4", m, n, k, GROUP)
                add("kiln triton int4 (chosen)", graph_time(
                    lambda i: triton_linear("int4", x, *int4[i], GROUP, config=cfg), len(int4)), bytes_["int4"], cfg)
                print(f"{name} M={m}: " + ", ".join(f"{r['system']} {r['us']:.1f}us" for r in records
                                                    if r["shape"] == name and r["m"] == m), flush=True)
                continue
            dense = [(b, None) for b in bf16]
            for scheme, weights in (("fp8", fp8), ("int4", int4), ("dense", dense)):
                if scheme not in args.schemes.split(",") or (scheme == "dense" and m != 1):
                    continue
                if scheme == "int4":
                    want = quant.linear_reference(scheme)(x, *weights[0], GROUP)
                elif scheme == "fp8":
                    want = x.float() @ quant.dequant_fp8_reference(*weights[0], GROUP, torch.float32).t()
                else:
                    want = x.float() @ weights[0][0].float().t()
                configs = list(sweep_configs(scheme, m)) if args.sweep and m in (1, 16) else []
                configs.append(config_for(scheme, m, n, k, GROUP))
                results = []
                for cfg in dict.fromkeys(configs):
                    try:
                        got = triton_linear(scheme, x, *weights[0], GROUP, config=cfg)
                        sec = graph_time(lambda i: triton_linear(scheme, x, *weights[i], GROUP, config=cfg),
                                         len(weights), reps=3)
                    except Exception as e:  # a tile that does not compile (shared memory) is skipped
                        print(f"{scheme} {name} M={m} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    if not err < 1e-2:  # a wrong kernel is not a fast one
                        print(f"{scheme} {name} M={m} {cfg}: WRONG, relative error {err:.3g}", flush=True)
                        continue
                    results.append((sec, cfg))
                sec, cfg = min(results, key=lambda r: r[0])
                add(f"kiln triton {scheme} (best)", sec, bytes_[scheme], cfg)
                default = config_for(scheme, m, n, k, GROUP)
                chosen = next((s for s, c in results if c == default), None)
                if chosen is not None and chosen != sec:
                    add(f"kiln triton {scheme} (chosen)", chosen, bytes_[scheme], default)
                best[f"{scheme},{m},{n},{k}"] = list(cfg.__dict__.values())
            print(f"{name} M={m}: " + ", ".join(f"{r['system']} {r['us']:.1f}us {r['copy_bw_pct']:.0f}%"
                                                for r in records if r["shape"] == name and r["m"] == m), flush=True)
        del bf16, fp8, int4, tiny
        torch.cuda.empty_cache()
    meta = {"device": device_name(), "torch": torch.__version__, "copy_bandwidth_gb_s": bandwidth / 1e9,
            "group_size": GROUP, "sweep": args.sweep}
    (out / "quant_gemm.json").write_text(json.dumps({"meta": meta, "records": records, "best": best}, indent=1))
    header = ["shape", "M", "system", "us", "GB/s", "% copy bw", "config (bm, bn, bk, split, warps, stages)"]
    table = console_table(header, [[r["shape"], r["m"], r["system"], r["us"], r["gb_s"], r["copy_bw_pct"],
                                    "" if r["config"] is None else str(r["config"])] for r in records])
    md = [f"# Quantized GEMMs at llama3-8b shapes ({meta['device']})", "",
          f"Copy bandwidth {meta['copy_bandwidth_gb_s']:.0f} GB/s (read + write); one call per CUDA-graph node, "
          "weights cycled past the L2 cache; bytes at the stored sizes (int4: group 32, bf16 scale + zero).", "",
          "```", table, "```", ""]
    (out / "quant_gemm.md").write_text("\n".join(md))
    print(table)


def _linear_fp8_scaled_mm_large(x, w, s):
    """kiln's FP8 op as it runs above the Triton row limit: per-token quantization + ``_scaled_mm``."""
    from kiln.ops.triton_quant import triton_quantize_fp8_per_token

    xq, xs = triton_quantize_fp8_per_token(x)
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.reshape(1, -1), out_dtype=torch.bfloat16)


if __name__ == "__main__":
    main()
