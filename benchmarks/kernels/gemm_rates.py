"""bf16 GEMM rates at llama3-8b's linear shapes by rows: cuBLAS (``F.linear``) and Inductor max-autotune.

Rows are the step's tokens (64-512: decode batches; 4096: a mixed step). Times are medians of 30
CUDA-event-timed calls after five untimed ones, weights not cycled past the L2; ``--autotune-rows``
also compiles ``F.linear`` with ``mode="max-autotune-no-cudagraphs"`` (Triton templates and cuBLAS)
for the body's shapes at those rows. Results: ``gemm_rates-llama3-8b.json``.

    python -m benchmarks.kernels gemm-rates --out $OUT      # H200: about a minute
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import out_dir

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # (out, in) features


def median_s(fn, iters: int = 30) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="64,256,512,4096")
    p.add_argument("--autotune-rows", default="512", help="rows at which max-autotune runs too ('' for none)")
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    autotune = {int(r) for r in args.autotune_rows.split(",") if r}
    records = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = median_s(lambda: F.linear(x, w))
            rec = {"shape": name, "m": m, "n": n, "k": k, "cublas_us": t * 1e6, "cublas_tflops": 2 * m * n * k / t / 1e12}
            if m in autotune and name != "lm_head":
                torch._dynamo.reset()
                f = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
                t0 = time.perf_counter()
                f(x, w)
                torch.cuda.synchronize()
                rec["autotune_s"] = time.perf_counter() - t0
                ta = median_s(lambda: f(x, w))
                rec["autotune_us"], rec["autotune_tflops"] = ta * 1e6, 2 * m * n * k / ta / 1e12
            records.append(rec)
            print(json.dumps(rec), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_rates-llama3-8b.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "rows": records}, indent=1))
    print(f"{'shape':8s} {'rows':>5s} {'cuBLAS us':>10s} {'TFLOP/s':>8s} {'autotune us':>12s} {'TFLOP/s':>8s}")
    for r in records:
        print(f"{r['shape']:8s} {r['m']:5d} {r['cublas_us']:10.1f} {r['cublas_tflops']:8.0f} "
              f"{r.get('autotune_us', 0):12.1f} {r.get('autotune_tflops', 0):8.0f}")


if __name__ == "__main__":
    main()
