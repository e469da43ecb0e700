"""CPU decode speed of SmolLM2-135M by precision: fp32, bf16, int8 and int4 weights, one process.

Systems (``model.quantization`` / ``model.dtype``), all kiln ``compile.mode=eager`` unless
``--modes`` adds ``kiln``:

    fp32        none / float32     the baseline every speed-up divides by
    bf16        none / bfloat16    AMX/AVX512-BF16 matmuls, float32 accumulation
    int8        int8 / float32     torch's packed int8 weight-only GEMM (bf16 activations inside)
    int4        auto / float32     the GGUF's Q4_1 blocks through torch's packed int4 GEMM
    int4-bf16   auto / bfloat16    the same weights in a bf16 model (no activation casts)
    int4-bf16head auto / float32   int4 with its one-row LM head in bfloat16, not Q8_0 (the tree
                                   before kiln_cpu::gemv_q8_0; the before of a same-run comparison)

For each, batch 1 and batch ``--batch`` (16): ``--prompt-len`` prompt tokens per request,
``--output-len`` new tokens, greedy with ``ignore_eos``. The decode step time is
``(t(output_len) - t(1)) / (output_len - 1)`` (prefill cancels); tok/s is requests / step time.
All systems are built first, then timed in ``--repeats`` interleaved rounds (each number a median),
so a shared machine's load changes hit every system alike; the load average is recorded.
Also reported: the bytes of weights one step reads (decoder linears as stored, the tied embedding
as the LM head) and the speed-up over fp32 in the same run.

    python -m benchmarks.offline quant-cpu --out $OUT
    python -m benchmarks.offline quant-cpu --systems fp32,int4 --output-len 8 --batch 4   # smoke
    python -m benchmarks.offline quant-cpu --pairs fp32:eager,int4:kiln,int4-bf16head:kiln --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import console_table, device_name, out_dir, timed_generate, weight_bytes_per_step

SYSTEMS = {
    "fp32": ("none", "float32"), "bf16": ("none", "bfloat16"), "int8": ("int8", "float32"),
    "int4": ("auto", "float32"), "int4-bf16": ("auto", "bfloat16"), "int4-bf16head": ("auto", "float32"),
}
BF16_HEAD = {"int4-bf16head"}  # systems whose model drops its Q8_0 head (kiln.ops.cpu_linear.Q8Head)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--systems", default=",".join(s for s in SYSTEMS if s not in BF16_HEAD))
    p.add_argument("--modes", default="eager", help="compile.mode values: eager and/or kiln")
    p.add_argument("--pairs", default="", help="system:mode pairs instead of --systems x --modes "
                   "(e.g. fp32:eager,int4:kiln)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="rounds over all systems; each number is a median")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, one per core)")
    p.add_argument("--out", default=str(out_dir()))
    p.add_argument("--stem", default="quant_cpu")
    return p.parse_args(argv)


def build_system(name: str, mode: str, args):
    from kiln import LLM

    quantization, dtype = SYSTEMS[name]
    llm = LLM(model={"model": args.model, "quantization": quantization, "dtype": dtype, "max_model_len": 1024},
              compile={"mode": mode}, scheduler={"max_num_seqs": max(args.batch, 1)})
    if name in BF16_HEAD:
        llm.engine.executor.runner.model.head_q8 = None  # compute_logits reads it each call
    return llm


def timed(llm, batch: int, new_tokens: int, args) -> float:
    gen = torch.Generator().manual_seed(batch * 1000 + new_tokens)
    return timed_generate(llm, torch.randint(100, 40000, (batch, args.prompt_len), generator=gen).tolist(), new_tokens)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    systems = [tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else \
        [(name, mode) for mode in args.modes.split(",") for name in args.systems.split(",")]
    llms, records = {}, {}
    for key in systems:
        t0 = time.perf_counter()
        llms[key] = build_system(*key, args)
        timed(llms[key], 1, 4, args)  # warm-up (and, for kiln, the compile)
        timed(llms[key], args.batch, 4, args)
        model = llms[key].engine.executor.runner.model
        records[key] = {"system": key[0], "mode": key[1], "quantization": SYSTEMS[key[0]][0],
                        "dtype": SYSTEMS[key[0]][1], "build_s": round(time.perf_counter() - t0, 1),
                        "weight_mb_per_step": weight_bytes_per_step(model) / 1e6 if model is not None else None}
    samples = {key: {1: [], args.batch: []} for key in systems}
    for r in range(args.repeats):  # rounds: every system once per round, so load changes hit all alike
        for key in systems:
            for batch in (1, args.batch):
                t1, tn = timed(llms[key], batch, 1, args), timed(llms[key], batch, args.output_len, args)
                samples[key][batch].append((tn - t1) / (args.output_len - 1))
        print(f"round {r + 1}/{args.repeats} done, load {os.getloadavg()[0]:.2f}", flush=True)
    for key in systems:
        rec = records[key]
        for batch in (1, args.batch):
            step = statistics.median(samples[key][batch])
            rec[f"b{batch}_step_ms"] = 1e3 * step
            rec[f"b{batch}_tok_s"] = batch / step
            rec[f"b{batch}_step_ms_all"] = [round(1e3 * s, 2) for s in samples[key][batch]]
    records = list(records.values())
    base = next((r for r in records if r["system"] == "fp32" and r["mode"] == "eager"), None)
    for r in records:
        for batch in (1, args.batch):
            if base is not None:
                r[f"b{batch}_speedup"] = r[f"b{batch}_tok_s"] / base[f"b{batch}_tok_s"]
    meta = {"device": device_name(), "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "torch": torch.__version__, "model": args.model,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "batch": args.batch,
            "repeats": args.repeats, "load_avg_start": load_start[0], "load_avg_end": os.getloadavg()[0]}
    (out / f"{args.stem}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    md = render(meta, records)
    (out / f"{args.stem}.md").write_text(md)
    print(md)


def render(meta: dict, records: list[dict]) -> str:
    """The markdown report: medians (and the best round, least disturbed by other jobs)."""
    b = meta["batch"]
    header = ["system", "mode", "weights MB/step", "b1 step ms", "b1 best ms", "b1 tok/s", "b1 x fp32",
              f"b{b} step ms", f"b{b} best ms", f"b{b} tok/s", f"b{b} x fp32"]
    rows = [[r["system"], r["mode"], r.get("weight_mb_per_step", ""), r["b1_step_ms"], min(r["b1_step_ms_all"]),
             r["b1_tok_s"], r.get("b1_speedup", ""), r[f"b{b}_step_ms"], min(r[f"b{b}_step_ms_all"]),
             r[f"b{b}_tok_s"], r.get(f"b{b}_speedup", "")] for r in records]
    md = [f"# SmolLM2 CPU decode by precision ({meta['cpu']}, {meta['threads']} threads of {meta['cores']} cores, "
          f"torch {meta['torch']})",
          "", f"prompt {meta['prompt_len']}, {meta['output_len']} new tokens, greedy; medians of {meta['repeats']} "
          f"interleaved rounds (best: the fastest round); speed-ups (medians) over fp32 eager, same run; load "
          f"average {meta['load_avg_start']:.2f} at start, {meta['load_avg_end']:.2f} at end.", "",
          "```", console_table(header, rows), "```", ""]
    return "\n".join(md)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
