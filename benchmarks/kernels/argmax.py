"""Greedy argmax of the logits at decode rows: torch's ``argmax(-1)`` against kiln's Triton kernel.

Each time is one call replayed from a CUDA graph (``quant_gemm.graph_time``), as the argmax runs at
the end of a full decode graph; both read the same float32 logits. Writes ``<out>/argmax-<card>.json``
and prints a table.

    python -m benchmarks.kernels argmax --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import console_table, device_name, out_dir
from benchmarks.kernels.quant_gemm import graph_time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,8,32,128,512")
    p.add_argument("--vocab", type=int, default=128256)  # llama3's
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)
    from kiln.ops.triton_argmax import triton_argmax

    records, table = [], []
    for rows in (int(r) for r in args.rows.split(",")):
        copies = [torch.randn(rows, args.vocab, device="cuda") for _ in range(4)]
        for x in copies:
            assert torch.equal(triton_argmax(x), x.argmax(-1))
        torch_us = graph_time(lambda i: copies[i].argmax(-1), len(copies)) * 1e6
        triton_us = graph_time(lambda i: triton_argmax(copies[i]), len(copies)) * 1e6
        records.append(dict(rows=rows, vocab=args.vocab, torch_us=torch_us, triton_us=triton_us))
        table.append([rows, torch_us, triton_us, torch_us / triton_us])
    print(console_table(["rows", "torch us", "triton us", "speedup"], table))
    out = Path(args.out) / f"argmax-{device_name().replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=device_name(), records=records), indent=1))


if __name__ == "__main__":
    main()
