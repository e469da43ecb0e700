"""Batch-1 decode: step time and the GPU kernels of one step, with the step's CUDA graph as served.

For each ``preset:quantization`` system: kiln (``compile.mode=kiln``, full CUDA graphs, capture
sizes 1, 2, 4), the ms per decode step (prompt ``--prompt-len``, step = (t(n) - t(1)) / (n - 1),
as ``gpu_decode.py`` measures it), then torch.profiler over a run of ``1 + --profile-tokens`` new
tokens minus a run of one (``quant_gpu.profile_decode``), the graphs left on: the kernels of the
replayed graph, per step, by name. ``kernel ms`` is their sum; ``step ms - kernel ms`` is what the
GPU spends between kernels (launch gaps inside the graph) plus the host's share of the step.

A system may end in kernel options, ``@kernels.NAME=VALUE+kernels.NAME=VALUE`` (``kiln.config.KernelConfig``;
a list as schemes joined by ``/``, empty for none), to measure one against the defaults:

    python -m benchmarks.decode profile --systems llama3-8b:int4,llama3-8b:int4@kernels.pdl=off --out $OUT
    python -m benchmarks.decode profile --systems llama3-8b:none@kernels.gemv_join=+kernels.rope_join=false

Run once per tree in the same device call to compare two versions of kiln:

    python -m benchmarks.decode profile --label before --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import console_table, copy_bandwidth, device_name, out_dir
from benchmarks.decode.gpu import weight_bytes_per_step
from benchmarks.offline.quant_gpu import profile_decode, profile_table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default="llama3-8b:none,llama3-8b:int4,qwen2.5-0.5b:none",
                   help="comma-separated preset:quantization[:int4 group size][@kernels.NAME=VALUE+kernels.NAME=VALUE]")
    p.add_argument("--label", default="kiln", help="names this tree's rows and files")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--profile-tokens", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no new system after this many seconds")
    p.add_argument("--int4-configs", default="",
                   help="an int4_gemv_shapes.json: its best one-row GEMV configurations replace MEASURED's")
    p.add_argument("--gemm-configs", default="",
                   help="a JSON whose 'best' maps 'scheme,M,N,K' to a tile (gemv_join.py --sweep writes one): "
                        "loaded over kiln.ops.triton_quant_gemm's tables")
    p.add_argument("--out", default=str(out_dir()))
    return p.parse_args(argv)


def load_int4_configs(path: str) -> dict:
    """The configurations ``benchmarks/int4_gemv_shapes.py`` picked for an end-to-end run (shape name
    -> its tile) over ``kiln.ops.triton_quant_gemm``'s tables (one-row int4)."""
    from kiln.ops.triton_quant_gemm import load_measured

    from quant_gemm import SHAPES

    found = json.loads(Path(path).read_text())
    best = found.get("e2e") or found["best"]
    # [block_n, block_k, warps, stages] (a one-program GEMV tile) or every GemmConfig field
    entries = {f"int4,1,{SHAPES[name][0]},{SHAPES[name][1]}": [1, c[0], c[1], 1, c[2], c[3]] if len(c) == 4 else c
               for name, c in best.items()}
    load_measured(entries)
    return entries


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_settings(text: str) -> dict[str, Any]:
    """``kernels.NAME=VALUE+...`` (what follows a system's @) as ``KernelConfig`` fields: true / false,
    whole numbers, null, ``gemv_join`` as schemes joined by / (empty: none), else the text. A bad
    key or value is the config's error, before anything loads."""
    from kiln.config import KernelConfig

    names = {f.name for f in dataclasses.fields(KernelConfig)}
    settings: dict[str, Any] = {}
    for item in filter(None, text.split("+")):
        key, eq, value = item.partition("=")
        name = key.removeprefix("kernels.")
        if not eq or not key.startswith("kernels.") or name not in names:
            raise ValueError(f"@{item}: expected kernels.NAME=VALUE, NAME one of {sorted(names)}")
        if name == "gemv_join":
            settings[name] = tuple(filter(None, value.split("/")))
        else:
            words = {"true": True, "false": False, "null": None}
            settings[name] = words[value] if value in words else int(value) if value.isdigit() else value
    KernelConfig(**settings)
    return settings


def run_system(system: str, args, bandwidth: float) -> tuple[dict, str]:
    """``system``: preset:quantization[:group], optionally @ kernel options (``kernel_settings``)."""
    from kiln import LLM, SamplingParams

    system_name, _, options = system.partition("@")
    kernels = kernel_settings(options)

    preset, _, quantization = system_name.partition(":")
    quantization, _, group = quantization.partition(":")  # int4:128 -> int4 in groups of 128 columns
    model_options = {"int4_group_size": int(group)} if group else {}
    t0 = time.perf_counter()
    llm = LLM(model={"model": f"random:{preset}", "dtype": "bfloat16", "quantization": quantization or "none",
                     "max_model_len": args.max_model_len, **model_options},
              compile={"mode": "kiln", "cudagraph": "full", "capture_sizes": (1, 2, 4)},
              cache={"gpu_memory_fraction": 0.85}, scheduler={"max_num_seqs": 4}, kernels=kernels)
    startup_s = time.perf_counter() - t0
    model = llm.engine.executor.runner.model
    prompt = [torch.randint(100, 20000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()]

    def generate(new_tokens: int, repeats: int = 2):
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        best, tokens = float("inf"), None
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            outs = llm.generate([prompt[0]], params, use_tqdm=False)
            sync()
            best = min(best, time.perf_counter() - t)
            tokens = outs[0].outputs[0].token_ids
        return best, tokens

    generate(8, repeats=1)
    t1, _ = generate(1, repeats=3)
    tn, tokens = generate(args.output_len, repeats=3)
    step = (tn - t1) / (args.output_len - 1)
    weight_bytes = weight_bytes_per_step(model)
    prof = profile_decode(lambda n: generate(n, repeats=1), args.profile_tokens)
    record = {"label": args.label, "system": system, "step_ms": 1e3 * step, "tok_s": 1 / step,
              "roofline_pct": 100 * (weight_bytes / bandwidth) / step, "weight_gb": weight_bytes / 1e9,
              "kernel_ms": prof["kernel_us"] / 1e3, "kernels_per_step": sum(v["calls"] for v in prof["kernels"].values()),
              "startup_s": startup_s, "first_tokens": list(tokens[:16]), "profile": prof}
    table = profile_table(f"{args.label} {system}", prof)
    llm.engine.shutdown()
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()
    return record, table


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.int4_configs:
        print(f"int4 GEMV configurations: {load_int4_configs(args.int4_configs)}", flush=True)
    if args.gemm_configs:
        from kiln.ops.triton_quant_gemm import load_measured

        entries = json.loads(Path(args.gemm_configs).read_text())["best"]
        load_measured(entries)
        print(f"GEMM configurations loaded: {entries}", flush=True)
    bandwidth = copy_bandwidth()
    records, tables = [], []
    for system in args.systems.split(","):
        if time.perf_counter() - t0 > args.deadline_s:
            print(f"deadline: {system} not run", flush=True)
            continue
        record, table = run_system(system, args, bandwidth)
        records.append(record)
        tables.append(table)
        print(table, flush=True)
        print(f"{args.label} {system}: step {record['step_ms']:.3f} ms, kernels {record['kernel_ms']:.3f} ms "
              f"({record['kernels_per_step']:.0f} a step), {record['roofline_pct']:.1f}% of roofline", flush=True)
    meta = {"device": device_name(), "copy_bandwidth_gb_s": bandwidth / 1e9, "torch": torch.__version__,
            "prompt_len": args.prompt_len, "output_len": args.output_len}
    (out / f"decode_profile-{args.label}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    (out / f"decode_profile-{args.label}.txt").write_text("\n".join(tables))
    rows = [[r["label"], r["system"], r["step_ms"], r["kernel_ms"], r["step_ms"] - r["kernel_ms"],
             r["kernels_per_step"], r["roofline_pct"]] for r in records]
    print(console_table(["tree", "system", "step ms", "kernel ms", "step - kernels", "kernels", "% roofline"], rows))


if __name__ == "__main__":
    main()
