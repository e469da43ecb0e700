"""int4 weight-only linears on the CPU: kiln's float32 kernel (``kiln_cpu::linear_int4_packed``,
``csrc/gemv.cpp``) against torch's ``aten._weight_int4pack_mm_for_cpu`` on the same packed weights.

SmolLM2-135M's shapes at each row count of ``--rows``, groups of 32, weights cycled over ``--bytes``
so that they come from memory; best of ``--rounds``; each kernel's error against the float64
product with the dequantized weight.

    python -m benchmarks.kernels cpu-int4 --rows 1,2,8,16,64
"""
from __future__ import annotations

import argparse
import json
import re
import time

import torch


from benchmarks.common import console_table, out_dir
from kiln.bench.report import cpu_model

import kiln._C  # noqa: F401  (the kiln_cpu ops)
from kiln.ops import quant

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best_us(fn, copies: int, rounds: int) -> float:
    for i in range(3):
        fn(i % copies)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(copies):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / copies)
    return best * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bytes", type=float, default=256e6, help="packed weight copies cycled per shape")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--rows", default="1", help="comma-separated row counts of x")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for m in [int(r) for r in args.rows.split(",")]:
        for name, (n, k) in SHAPES.items():
            w, sz = quant.quantize_int4(torch.randn(n, k), args.group)
            pw, psz = quant.pack_int4_cpu(w, sz, args.group)
            x = torch.randn(m, k)
            want = x.double() @ quant.dequant_int4_reference(w, psz, args.group, torch.float64).t()
            copies = max(2, int(args.bytes // pw.numel()))
            ws, ss = [pw.clone() for _ in range(copies)], [psz.clone() for _ in range(copies)]
            xb = x.to(torch.bfloat16)
            torch_us = best_us(lambda i: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, ws[i], args.group, ss[i]),
                               copies, args.rounds)
            kiln_us = best_us(lambda i: torch.ops.kiln_cpu.linear_int4_packed(x, ws[i], ss[i], args.group),
                              copies, args.rounds)
            nbytes = pw.numel() + psz.numel() * psz.element_size()
            err = {key: ((y.double() - want).abs().max() / want.abs().max()).item() for key, y in (
                ("torch", torch.ops.aten._weight_int4pack_mm_for_cpu(xb, pw, args.group, psz)),
                ("kiln", torch.ops.kiln_cpu.linear_int4_packed(x, pw, psz, args.group)))}
            rows.append({"rows": m, "shape": name, "n": n, "k": k, "mb": nbytes / 1e6, "torch_us": torch_us,
                         "kiln_us": kiln_us, "torch_gb_s": nbytes / torch_us / 1e3, "kiln_gb_s": nbytes / kiln_us / 1e3,
                         "speedup": torch_us / kiln_us, "torch_rel_err": err["torch"], "kiln_rel_err": err["kiln"]})
            print(rows[-1], flush=True)
        layer = [r for r in rows if r["rows"] == m]
        rows.append({"rows": m, "shape": "a layer", "n": 0, "k": 0, "mb": sum(r["mb"] for r in layer),
                     "torch_us": sum(r["torch_us"] for r in layer), "kiln_us": sum(r["kiln_us"] for r in layer),
                     "torch_rel_err": max(r["torch_rel_err"] for r in layer),
                     "kiln_rel_err": max(r["kiln_rel_err"] for r in layer)})
        last = rows[-1]
        last.update(torch_gb_s=last["mb"] / last["torch_us"] * 1e3, kiln_gb_s=last["mb"] / last["kiln_us"] * 1e3,
                    speedup=last["torch_us"] / last["kiln_us"])
    cpu = cpu_model()
    header = ["rows", "shape", "N x K", "MB", "torch us (GB/s)", "kiln us (GB/s)", "kiln x torch", "rel. error torch / kiln"]
    table = [[str(r["rows"]), r["shape"], f"{r['n']} x {r['k']}" if r["n"] else "", f"{r['mb']:.2f}", f"{r['torch_us']:.1f} ({r['torch_gb_s']:.1f})",
              f"{r['kiln_us']:.1f} ({r['kiln_gb_s']:.1f})", f"{r['speedup']:.2f}x",
              f"{r['torch_rel_err']:.1e} / {r['kiln_rel_err']:.1e}"] for r in rows]
    print(console_table(header, table))
    slug = re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-")
    out = out_dir() / f"cpu_int4-{slug}"
    meta = {"cpu": cpu, "threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability(),
            "group": args.group, "rounds": args.rounds, "row_counts": args.rows, "torch": torch.__version__}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# int4 linears at SmolLM2's shapes: {cpu}, {meta['threads']} threads", "",
          f"`python -m benchmarks.kernels cpu-int4 --rows {args.rows}` (groups of {args.group}, torch {torch.__version__}, dispatch "
          f"{meta['capability']}): weights cycled over {args.bytes / 1e6:.0f} MB, best of {args.rounds} rounds. "
          "Relative error: max |y - y64| / max |y64| against the float64 product.", "",
          "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    md += ["| " + " | ".join(row) + " |" for row in table]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
