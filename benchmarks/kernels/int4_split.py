"""int4 one-row GEMV: split-K (a zeroed float32 output, atomics, a cast) against one pass per row block.

Split-K fills the GPU on layers with few output rows (llama3-8b's o and down: 4096), but costs
two extra kernels a call inside the decode graph (the zero fill and the cast to bf16). This times
each configuration as the op runs it (``triton_linear``, fill and cast included), replayed from a
CUDA graph over weight copies past the L2 (``quant_gemm.graph_time``), for the shapes given.

    python -m benchmarks.kernels int4-split --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import console_table, copy_bandwidth, device_name, out_dir
from benchmarks.kernels.quant_gemm import GROUP, SHAPES, graph_time

# (block_n, block_k, split_k, num_warps, num_stages)
CONFIGS = [(16, 1024, 4, 4, 1), (16, 1024, 2, 4, 1), (16, 1024, 1, 4, 1), (8, 1024, 1, 4, 1), (8, 2048, 1, 4, 1),
           (8, 1024, 1, 2, 1), (16, 2048, 1, 8, 1), (8, 4096, 1, 4, 1), (8, 2048, 1, 8, 1), (4, 2048, 1, 2, 1),
           (8, 2048, 1, 4, 2)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="down,o,qkv")
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)
    from kiln.ops import quant
    from kiln.ops.triton_quant_gemm import GemmConfig, config_for, triton_linear

    bandwidth = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, records = [], []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
        q4, sz4 = quant.quantize_int4(w, GROUP, torch.bfloat16)
        copies = max(2, -(-(160 << 20) // (n * k // 2)))
        weights = [(q4.clone(), sz4.clone()) for _ in range(copies)]
        x = torch.randn(1, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k // 2 + (k // GROUP) * n * 4
        want = x.float() @ quant.dequant_int4_reference(q4, sz4, GROUP, torch.float32).T
        current = config_for("int4", 1, n, k, GROUP)
        for bn, bk, split, nw, ns in CONFIGS:
            cfg = GemmConfig(1, bn, bk, split, num_warps=nw, num_stages=ns)
            got = triton_linear("int4", x, q4, sz4, GROUP, config=cfg).float()
            err = ((got - want).norm() / want.norm()).item()
            t = graph_time(lambda i: triton_linear("int4", x, *weights[i], GROUP, config=cfg), copies)
            rec = {"shape": name, "config": [bn, bk, split, nw, ns], "us": t * 1e6,
                   "copy_bw_pct": 100 * nbytes / t / bandwidth, "rel_err": err, "current": cfg == current}
            records.append(rec)
            rows.append([name, f"{bn}x{bk} split {split} w{nw} s{ns}" + (" *" if rec["current"] else ""),
                         rec["us"], rec["copy_bw_pct"], err])
            print(rows[-1], flush=True)
    table = console_table(["shape", "config (* = MEASURED)", "us", "% copy bw", "rel err"], rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_gemv_split.json").write_text(json.dumps({"device": device_name(), "records": records}, indent=1))


if __name__ == "__main__":
    main()
