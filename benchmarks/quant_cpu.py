"""CPU decode speed of SmolLM2-135M by precision: fp32, bf16, int8 and int4 weights, one process.

Systems (``model.quantization`` / ``model.dtype``), all kiln ``compile.mode=eager`` unless
``--modes`` adds ``kiln``:

    fp32        none / float32     the baseline every speed-up divides by
    bf16        none / bfloat16    AMX/AVX512-BF16 matmuls, float32 accumulation
    int8        int8 / float32     torch's packed int8 weight-only GEMM (bf16 activations inside)
    int4        auto / float32     the GGUF's Q4_1 blocks through torch's packed int4 GEMM
    int4-bf16   auto / bfloat16    the same weights in a bf16 model (no activation casts)

For each, batch 1 and batch ``--batch`` (16): ``--prompt-len`` prompt tokens per request,
``--output-len`` new tokens, greedy with ``ignore_eos``. The decode step time is
``(t(output_len) - t(1)) / (output_len - 1)`` (prefill cancels); tok/s is requests / step time.
Also reported: the bytes of weights one step reads (decoder linears as stored, the tied embedding
as the LM head) and the speed-up over fp32 in the same run.

    PYTHONPATH=$PWD python benchmarks/quant_cpu.py --out $OUT
    PYTHONPATH=$PWD python benchmarks/quant_cpu.py --systems fp32,int4 --output-len 8 --batch 4   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from common import console_table, device_name, weight_bytes_per_step

SYSTEMS = {
    "fp32": ("none", "float32"), "bf16": ("none", "bfloat16"), "int8": ("int8", "float32"),
    "int4": ("auto", "float32"), "int4-bf16": ("auto", "bfloat16"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--modes", default="eager", help="compile.mode values: eager and/or kiln")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    return p.parse_args(argv)


def run_system(name: str, mode: str, args) -> dict:
    from kiln import LLM, SamplingParams

    quantization, dtype = SYSTEMS[name]
    llm = LLM(model={"model": args.model, "quantization": quantization, "dtype": dtype, "max_model_len": 1024},
              compile={"mode": mode}, scheduler={"max_num_seqs": max(args.batch, 1)})
    model = llm.engine.executor.runner.model
    gen = torch.Generator().manual_seed(0)

    def timed(batch: int, new_tokens: int) -> float:
        prompts = torch.randint(100, 40000, (batch, args.prompt_len), generator=gen).tolist()
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        return best

    record = {"system": name, "mode": mode, "quantization": quantization, "dtype": dtype}
    timed(1, 4)  # warm-up
    for batch in (1, args.batch):
        t1, tn = timed(batch, 1), timed(batch, args.output_len)
        step = (tn - t1) / (args.output_len - 1)
        record[f"b{batch}_step_ms"] = 1e3 * step
        record[f"b{batch}_tok_s"] = batch / step
    if model is not None:
        record["weight_mb_per_step"] = weight_bytes_per_step(model) / 1e6
    del llm
    return record


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for mode in args.modes.split(","):
        for name in args.systems.split(","):
            t0 = time.perf_counter()
            records.append(run_system(name, mode, args))
            print(f"{name}/{mode}: {records[-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    base = next((r for r in records if r["system"] == "fp32" and r["mode"] == "eager"), None)
    for r in records:
        for batch in (1, args.batch):
            if base is not None:
                r[f"b{batch}_speedup"] = r[f"b{batch}_tok_s"] / base[f"b{batch}_tok_s"]
    meta = {"device": device_name(), "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "model": args.model,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "batch": args.batch}
    (out / "quant_cpu.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    b = args.batch
    header = ["system", "mode", "weights MB/step", "b1 step ms", "b1 tok/s", "b1 x fp32",
              f"b{b} step ms", f"b{b} tok/s", f"b{b} x fp32"]
    rows = [[r["system"], r["mode"], r.get("weight_mb_per_step", ""), r["b1_step_ms"], r["b1_tok_s"],
             r.get("b1_speedup", ""), r[f"b{b}_step_ms"], r[f"b{b}_tok_s"], r.get(f"b{b}_speedup", "")]
            for r in records]
    table = console_table(header, rows)
    md = [f"# SmolLM2 CPU decode by precision ({meta['device']}, {meta['threads']} threads, torch {meta['torch']})",
          "", f"prompt {args.prompt_len}, {args.output_len} new tokens, greedy; speed-ups over fp32 eager, same run.",
          "", "```", table, "```", ""]
    (out / "quant_cpu.md").write_text("\n".join(md))
    print(table)


if __name__ == "__main__":
    main()
