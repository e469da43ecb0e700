"""LoRA at llama3-8b's linears: the base GEMM alone, with ``kiln_triton::add_lora`` after it, and
in the joined layout (the GEMM over W and every slot's A, then ``kiln_triton::expand_lora``).

Eight rank-16 slots, every llama3-8b site (qkv's three slices, o, gate_up's two, down), bf16; each
point the whole linear as served (kiln's dense GEMM: the Triton GEMV at one row, cuBLAS above,
then the LoRA kernels), per call, replayed from a CUDA graph cycling through enough weight copies
to defeat the L2 (``quant_gemm.graph_time``). Token mixes: one token with an adapter and without;
64 decode tokens over the 8 adapters round-robin and none; 512 prefill tokens of 4 adapters (128
each). ``torch ref`` is the pure-torch reference op (``add_lora_reference``, a dense GEMM over
every slot's ranks and a mask). Each kernel is checked against the reference first. Writes
``<out>/lora_kernels.json`` and prints a table.

    python -m benchmarks.kernels lora --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import console_table, device_name, out_dir
from benchmarks.kernels.quant_gemm import graph_time

SITES = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
         "down": (14336, [4096])}
COPY_BYTES = 512 << 20  # weight copies cycled per timing: well past the L2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--sites", default=",".join(SITES))
    p.add_argument("--out", default=str(out_dir()))
    return p.parse_args(argv)


def mixes(num_slots: int) -> dict[str, torch.Tensor]:
    i32 = dict(dtype=torch.int32, device="cuda")
    return {"1 adapter": torch.ones(1, **i32), "1 base": torch.zeros(1, **i32),
            "64 mixed": (torch.arange(64, **i32) % num_slots) + 1, "64 base": torch.zeros(64, **i32),
            "512 prefill x4": torch.arange(512, **i32) // 128 + 1}


def time_site(site: str, num_slots: int, rank: int) -> list[dict]:
    from kiln.ops.dense_linear import dense_linear
    from kiln.ops.lora import add_lora_reference
    from kiln.ops.triton_lora import (check_against_reference, check_expand_against_reference, triton_add_lora,
                                      triton_expand_lora)

    k, sizes = SITES[site]
    n, ranks = sum(sizes), len(sizes) * rank
    errors = {"add_lora": max(check_against_reference(t, k, sizes, rank, num_slots, torch.bfloat16, "cuda", t)
                              for t in (1, 64, 300)),
              "expand_lora": max(check_expand_against_reference(t, sizes, rank, num_slots, torch.bfloat16, "cuda", t)
                                 for t in (1, 64, 300))}
    copies = max(2, int(COPY_BYTES // ((n + num_slots * ranks) * k * 2)))
    joined = [torch.randn(n + num_slots * ranks, k, device="cuda").bfloat16() * 0.02 for _ in range(copies)]
    ws = [w[:n] for w in joined]  # the same W; A the tail
    a_s = [w[n:].view(num_slots, ranks, k) for w in joined]
    bs = [torch.randn(num_slots, ranks, n, device="cuda").bfloat16() * 0.01 for _ in range(copies)]
    rows = []
    for mix, slots in mixes(num_slots).items():
        x = torch.randn(slots.numel(), k, device="cuda").bfloat16()
        calls = {
            "base GEMM": lambda i: dense_linear(x, ws[i]),
            "GEMM + add_lora": lambda i: triton_add_lora(dense_linear(x, ws[i]), x, a_s[i], bs[i], sizes, slots),
            "joined GEMM + expand": lambda i: triton_expand_lora(dense_linear(x, joined[i]), bs[i], sizes, slots),
            "joined GEMM alone": lambda i: dense_linear(x, joined[i]),
            "GEMM + torch ref": lambda i: add_lora_reference(dense_linear(x, ws[i]), x, a_s[i], bs[i], sizes, slots),
        }
        row = {"site": site, "mix": mix, "num_tokens": slots.numel(), "n": n, "k": k, **errors}
        for name, fn in calls.items():
            row[f"{name} us"] = 1e6 * graph_time(fn, copies)
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for site in args.sites.split(",") for r in time_site(site, args.num_slots, args.rank)]
    names = ["base GEMM", "GEMM + add_lora", "joined GEMM + expand", "joined GEMM alone", "GEMM + torch ref"]
    table = console_table(["site", "tokens", *[f"{n} us" for n in names], "add_lora err", "expand err"],
                          [[r["site"], r["mix"], *[f"{r[f'{n} us']:.2f}" for n in names],
                            f"{r['add_lora']:.1e}", f"{r['expand_lora']:.1e}"] for r in rows])
    print(f"{device_name()}, llama3-8b linears, {args.num_slots} slots of rank {args.rank}, bf16\n{table}", flush=True)
    (out / "lora_kernels.json").write_text(json.dumps({"device": device_name(), "num_slots": args.num_slots,
                                                       "rank": args.rank, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
