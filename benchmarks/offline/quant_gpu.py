"""GPU decode speed by weight precision: bf16 vs FP8 (vs int4) for one random-weight model, one process.

For each system (``model.quantization``, ``+kv``: with ``cache.dtype=fp8``; all bf16 models, ``compile.mode=kiln``,
``compile.cudagraph=full``), in this one process:

- batch-1 decode: ``--prompt-len`` prompt, ``--output-len`` new tokens, greedy, ``ignore_eos``;
  the step time is ``(t(output_len) - t(1)) / (output_len - 1)``;
- offline throughput: ``--num-requests`` prompts of ``--tp-prompt-len`` tokens, ``--tp-output-len``
  new tokens each, all submitted at once (``--num-requests 0``: skipped);
- the bytes of weights one decode step reads at the stored (quantized) sizes, and the percent of the
  roofline ``copy bandwidth / bytes per step`` the batch-1 decode reaches (the device-to-device copy
  bandwidth is measured first, as ``python -m benchmarks.decode gpu`` does).

Speed-ups divide by bf16 in the same run. Results: ``<out>/quant_gpu.json`` and ``quant_gpu.md``,
written after every system. Stops starting systems after ``--deadline-s``.

    python -m benchmarks.offline quant-gpu --out $OUT                                   # H100, about 3 minutes
    python -m benchmarks.offline quant-gpu --model tiny --output-len 8 --num-requests 4 --tp-prompt-len 16 \\
        --tp-output-len 8 --mode eager --out /tmp/quant_gpu                     # smoke, CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.common import console_table, copy_bandwidth, device_name, out_dir, weight_bytes_per_step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b", help="random preset")
    p.add_argument("--systems", default="none,fp8+kv,int4",
                   help="model.quantization values (none: the bf16 baseline), '+kv' adds cache.dtype=fp8, "
                        "':tinygemm' runs int4 through torch's tinygemm kernel instead of the Triton one, "
                        "':prequant' makes fp8's joined norm/activation + GEMM ops quantize decode rows too, "
                        "':g128' quantizes int4 in groups of 128 columns (model.int4_group_size; default 32)")
    p.add_argument("--offline-systems", default="",
                   help="comma-separated systems that also run the offline throughput (default: all)")
    p.add_argument("--gemm-table", default="",
                   help="a quant_gemm.json whose measured tile configurations the Triton GEMMs use")
    p.add_argument("--mode", default="kiln")
    p.add_argument("--cudagraph", default="full")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--tp-prompt-len", type=int, default=128)
    p.add_argument("--tp-output-len", type=int, default=128)
    p.add_argument("--profile-tokens", type=int, default=0,
                   help="also profile this many batch-1 decode steps (torch.profiler; best with --cudagraph none) "
                        "and write each system's kernel table to <out>/quant_gpu-profile-<system>.txt")
    p.add_argument("--deadline-s", type=float, default=150.0)
    p.add_argument("--out", default=str(out_dir()))
    return p.parse_args(argv)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def llm_kernel(model) -> str:
    """The kernel the model's quantized linears run (for the record)."""
    from kiln.models.quantize import QuantLinear

    return ",".join(sorted({m.kernel.name for m in model.modules() if isinstance(m, QuantLinear)}))


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (num, length), generator=gen).tolist()


def run_system(system: str, args, bandwidth: float) -> dict:
    system, _, int4_kernel = system.partition(":")
    quantization, _, kv = system.partition("+")
    from kiln.ops import registry

    saved = dict(registry.REGISTRY)
    if int4_kernel == "tinygemm":
        registry.REGISTRY["linear_int4"] = (("cuda", registry._cuda_int4),) + saved["linear_int4"]
    triton_quant = None
    if int4_kernel == "prequant":
        from kiln.ops import triton_quant

        triton_quant.QUANTIZE_DECODE_ROWS = True
    group = int(int4_kernel[1:]) if int4_kernel[:1] == "g" and int4_kernel[1:].isdigit() else None
    try:
        return _run_system(system + (":" + int4_kernel if int4_kernel else ""), quantization, kv, args, bandwidth,
                           group)
    finally:
        registry.REGISTRY.clear()
        registry.REGISTRY.update(saved)
        if triton_quant is not None:
            triton_quant.QUANTIZE_DECODE_ROWS = False


def _run_system(system: str, quantization: str, kv: str, args, bandwidth: float, group: int = None) -> dict:
    from kiln import LLM, SamplingParams

    t_start = time.perf_counter()
    max_seqs = max(args.num_requests, 1)
    max_len = max(args.prompt_len, args.tp_prompt_len) + max(args.output_len, args.tp_output_len, 8)
    llm = LLM(model={"model": f"random:{args.model}", "dtype": "bfloat16", "quantization": quantization,
                     "max_model_len": max_len, **({"int4_group_size": group} if group else {})},
              compile={"mode": args.mode, "cudagraph": args.cudagraph,
                       "capture_sizes": tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if s <= max_seqs)},
              cache={"gpu_memory_fraction": 0.85, "dtype": "fp8" if kv == "kv" else "auto"},
              scheduler={"max_num_seqs": max_seqs, "max_num_batched_tokens": 4096})
    startup_s = time.perf_counter() - t_start
    model = llm.engine.executor.runner.model

    def generate(batch, new_tokens, repeats=2):
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        best = float("inf")
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            sync()
            best = min(best, time.perf_counter() - t0)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        return best, [o.outputs[0].token_ids for o in outs]

    one = prompts(1, args.prompt_len, seed=0)
    generate(one, 8, repeats=1)  # warm-up
    t1, _ = generate(one, 1)
    tn, tokens = generate(one, args.output_len)
    step = (tn - t1) / (args.output_len - 1)
    weight_bytes = weight_bytes_per_step(model)
    record = {"system": system, "quantization": quantization, "kv_cache": "fp8" if kv == "kv" else "bf16",
              "kv_cache_tokens": llm.engine.executor.runner.num_blocks * llm.engine.executor.runner.block_size,
              "startup_s": startup_s, "weight_gb_per_step": weight_bytes / 1e9,
              "b1_step_ms": 1e3 * step, "b1_tok_s": 1 / step,
              "b1_roofline_pct": 100 * (1 / step) / (bandwidth / weight_bytes), "first_tokens": tokens[0][:16]}
    record.update(offline_tok_s=float("nan"), offline_s=float("nan"), linear_kernel=llm_kernel(model))
    if args.profile_tokens > 0:
        record["profile"] = profile_decode(lambda n: generate(one, n, repeats=1), args.profile_tokens)
        (Path(args.out) / f"quant_gpu-profile-{system.replace(':', '-').replace('+', '-')}.txt").write_text(
            profile_table(system, record["profile"]))
    offline = not args.offline_systems or system in args.offline_systems.split(",")
    if args.num_requests > 0 and offline:  # 0: batch 1 only
        many = prompts(args.num_requests, args.tp_prompt_len, seed=1)
        t, _ = generate(many, args.tp_output_len, repeats=1)
        record.update(offline_tok_s=args.num_requests * args.tp_output_len / t, offline_s=t)
    del llm, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record


def profile_decode(generate, steps: int) -> dict:
    """GPU time per kernel name and decode step: a run of 1 + ``steps`` new tokens minus a run of 1
    (the prefill), each under torch.profiler, divided by ``steps``. Kernels inside CUDA graphs may
    not be seen: profile with ``--cudagraph none``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # on the CPU (a smoke run): the top-level ops instead of kernels
    activity, device_type = ((ProfilerActivity.CUDA, torch.autograd.DeviceType.CUDA) if cuda
                             else (ProfilerActivity.CPU, torch.autograd.DeviceType.CPU))

    def kernels(n: int) -> tuple[dict, float]:
        with profile(activities=[activity]) as prof:
            t, _ = generate(n)
        totals: dict[str, list] = {}
        for e in prof.events():
            if e.device_type == device_type and (cuda or e.cpu_parent is None):
                entry = totals.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += e.time_range.elapsed_us()
        return totals, t

    prefill, t1 = kernels(1)
    full, tn = kernels(1 + steps)
    per_step = {}
    for name, (count, us) in full.items():
        c0, us0 = prefill.get(name, (0, 0.0))
        if count > c0:
            per_step[name] = {"calls": (count - c0) / steps, "us": (us - us0) / steps}
    return {"step_ms_wall": 1e3 * (tn - t1) / steps, "kernel_us": sum(v["us"] for v in per_step.values()),
            "kernels": dict(sorted(per_step.items(), key=lambda kv: -kv[1]["us"]))}


def profile_table(system: str, prof: dict, top: int = 40) -> str:
    rows = [[name[:100], v["calls"], v["us"], 100 * v["us"] / max(prof["kernel_us"], 1e-9)]
            for name, v in list(prof["kernels"].items())[:top]]
    head = (f"{system}: decode step {prof['step_ms_wall']:.3f} ms wall (under the profiler), "
            f"{prof['kernel_us'] / 1e3:.3f} ms of kernels")
    return head + "\n\n" + console_table(["kernel", "calls/step", "us/step", "%"], rows) + "\n"


def write(out: Path, meta: dict, records: list[dict]) -> str:
    base = next((r for r in records if r["system"] == "none"), None)
    for r in records:
        if base is not None:
            r["b1_speedup"] = r["b1_tok_s"] / base["b1_tok_s"]
            r["offline_speedup"] = r["offline_tok_s"] / base["offline_tok_s"]
    (out / "quant_gpu.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    header = ["weights", "KV tokens", "GB/step", "b1 step ms", "b1 tok/s", "b1 x bf16", "b1 % roofline",
              f"offline {meta['num_requests']}x{meta['tp_prompt_len']}/{meta['tp_output_len']} tok/s", "offline x bf16",
              "start-up s"]
    rows = [[("bf16" if r["quantization"] == "none" else r["quantization"] + f" ({r['linear_kernel']})")
             + (" " + r["system"].partition(":")[2] if ":" in r["system"] else "")
             + (" + fp8 KV" if r["kv_cache"] == "fp8" else ""),
             r["kv_cache_tokens"], r["weight_gb_per_step"], r["b1_step_ms"],
             r["b1_tok_s"], r.get("b1_speedup", ""), r["b1_roofline_pct"], r["offline_tok_s"],
             r.get("offline_speedup", ""), r["startup_s"]] for r in records]
    table = console_table(header, rows)
    md = [f"# {meta['model']} decode by weight precision ({meta['device']})", "",
          f"compile.mode={meta['mode']}, cudagraph={meta['cudagraph']}, batch 1: prompt {meta['prompt_len']}, "
          f"{meta['output_len']} new tokens; copy bandwidth {meta['copy_bandwidth_gb_s']:.0f} GB/s; "
          "speed-ups over bf16 in the same run.", "", "```", table, "```", ""]
    (out / "quant_gpu.md").write_text("\n".join(md))
    return table


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bandwidth = copy_bandwidth()
    if args.gemm_table:
        from kiln.ops.triton_quant_gemm import load_measured

        load_measured(json.loads(Path(args.gemm_table).read_text())["best"])
    meta = {"device": device_name(), "model": f"random:{args.model}", "mode": args.mode, "cudagraph": args.cudagraph,
            "torch": torch.__version__, "copy_bandwidth_gb_s": bandwidth / 1e9,
            **{k: getattr(args, k) for k in ("prompt_len", "output_len", "num_requests", "tp_prompt_len",
                                             "tp_output_len")}}
    records = []
    for system in args.systems.split(","):
        if time.perf_counter() - t0 > args.deadline_s:
            print(f"deadline: {system} not run", flush=True)
            continue
        records.append(run_system(system, args, bandwidth))
        shown = {k: v for k, v in records[-1].items() if k != "profile"}
        print(f"{system}: {shown} ({time.perf_counter() - t0:.0f} s in)", flush=True)
        table = write(out, meta, records)
    print(table)


if __name__ == "__main__":
    main()
