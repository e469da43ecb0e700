"""Mixture of experts on one device, one process: the fused MoE kernel, then a MoE model offline.

1. Kernel: ``kiln_triton::fused_moe`` against the grouped pure-torch reference at Qwen3-30B-A3B's
   expert shapes (hidden 2048, 128 experts of 768, top-8, bf16) for 1, 64 and 512 tokens: time per
   call (CUDA events, median of repeats) and max error relative to the reference's max.
2. Model: offline throughput of ``random:qwen1.5-moe-a2.7b`` (Qwen2-MoE shapes, the first
   ``--num-layers`` of its 24 layers) in kiln (``compile.mode=kiln``, full CUDA graphs) beside
   transformers eager ``generate`` holding the same random weights: N prompts of P tokens, O new
   tokens each (greedy, no EOS), output tokens/s; plus how many greedy tokens agree.

    python -m benchmarks.offline moe            # the device run, sized to finish within 4 minutes on one H100
    python -m benchmarks.offline moe --smoke    # CPU, tiny shapes: the kernel part times the reference only
                                        # (and the Triton kernel too under TRITON_INTERPRET=1)

Writes ``moe.json`` and ``moe.md`` under ``--out`` (default ``$OUT``) and
prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time
import traceback

import torch


from benchmarks.common import console_table, out_dir
from kiln.models.arch import PRESETS
from kiln.ops.moe import fused_moe_reference

QWEN3_30B_EXPERTS = dict(hidden=2048, inter=768, num_experts=128, top_k=8)
SMOKE_EXPERTS = dict(hidden=64, inter=32, num_experts=8, top_k=2)


def _time_ms(fn, device: str, repeats: int) -> float:
    fn()  # warm-up (Triton compiles here)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def bench_kernel(shape: dict, token_counts: list[int], dtype: torch.dtype, device: str, repeats: int,
                 with_triton: bool) -> list[dict]:
    from kiln.ops.triton_moe import random_moe_inputs

    rows = []
    for n in token_counts:
        args = random_moe_inputs(n, shape["hidden"], shape["inter"], shape["num_experts"], shape["top_k"],
                                 dtype, device, seed=n)
        ref = fused_moe_reference(*args)
        row = {"tokens": n, "reference_ms": _time_ms(lambda: fused_moe_reference(*args), device, repeats)}
        if with_triton:
            from kiln.ops.triton_moe import triton_fused_moe

            got = triton_fused_moe(*args)
            row["triton_ms"] = _time_ms(lambda: triton_fused_moe(*args), device, repeats)
            row["speedup"] = row["reference_ms"] / row["triton_ms"]
            if device == "cuda":  # as the model runs it: replayed from a CUDA graph, no launch overhead
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    triton_fused_moe(*args)
                row["triton_graph_ms"] = _time_ms(graph.replay, device, repeats)
            row["max_abs_err"] = float((got.float() - ref.float()).abs().max())
            row["max_rel_err"] = row["max_abs_err"] / float(ref.float().abs().max())
        rows.append(row)
    return rows


def hf_state_from_kiln(kiln_model, hf_model) -> dict[str, torch.Tensor]:
    """transformers' state dict filled from kiln's tensors: checkpoint names where they match, the
    stacked expert tensors (transformers 5 holds ``experts.gate_up_proj`` / ``experts.down_proj``)
    from kiln's ``w13`` / ``w2`` (transposed where a version stores them [E, in, out])."""
    by_name = dict(kiln_model.weight_targets())
    state, missing = {}, []
    for key, value in hf_model.state_dict().items():
        m = re.match(r"model\.layers\.(\d+)\..*experts\.(gate_up_proj|down_proj)$", key)
        if m:
            mlp = kiln_model.layers[int(m.group(1))].mlp
            src = mlp.w13 if m.group(2) == "gate_up_proj" else mlp.w2
            if tuple(src.shape) != tuple(value.shape) and tuple(src.mT.shape) == tuple(value.shape):
                src = src.mT
        else:
            src = by_name.get(key)
        if src is None or tuple(src.shape) != tuple(value.shape):
            missing.append(key)
            continue
        state[key] = src
    if missing:
        raise RuntimeError(f"no kiln tensor for {len(missing)} transformers weights, e.g. {missing[:4]}")
    return state


def _model_arch(preset: str, num_layers: int, smoke: bool):
    arch = dataclasses.replace(PRESETS[preset], num_layers=num_layers)
    if smoke:  # tiny widths, same family and routing
        arch = dataclasses.replace(arch, vocab_size=512, hidden_size=64, intermediate_size=96, num_heads=4,
                                   num_kv_heads=4, head_dim=16, num_experts=6, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48, bos_token_id=1, eos_token_id=(2,))
    return arch


def _run_kiln(name: str, device: str, prompts: list[list[int]], output_len: int,
              mode: str = "kiln") -> tuple[dict, list, object]:
    """kiln's offline run: (metrics, greedy tokens, the engine, still holding the weights)."""
    from kiln import LLM, SamplingParams

    compile_cfg = {"mode": mode, "cudagraph": "full" if device == "cuda" else "none"}
    t0 = time.perf_counter()
    llm = LLM(f"random:{name}", device=device, cache={"kv_cache_memory_gib": 8.0 if device == "cuda" else 0.25},
              compile=compile_cfg)
    startup_s = time.perf_counter() - t0
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    kiln_s = time.perf_counter() - t0
    total = len(prompts) * output_len
    metrics = {"kiln_startup_s": startup_s, "kiln_s": kiln_s, "kiln_tok_s": total / kiln_s,
               "kernels": llm.engine.executor.runner.kernels.describe()}
    return metrics, [o.outputs[0].token_ids for o in outs], llm


def _run_hf(arch, kiln_model, device: str, prompts: list[list[int]], output_len: int) -> tuple[dict, list]:
    """transformers eager ``generate`` with kiln's weights: (metrics, greedy tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = next(kiln_model.parameters()).dtype
    hf_cfg = arch.to_hf_config()
    config = AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    with torch.device(device):  # initialized, rotary tables included; the weights are overwritten
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    hf.load_state_dict(hf_state_from_kiln(kiln_model, hf))
    hf.generation_config.eos_token_id = None  # as ignore_eos
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=output_len, do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        hf_s = time.perf_counter() - t0
    metrics = {"hf_eager_s": hf_s, "hf_eager_tok_s": len(prompts) * output_len / hf_s,
               "hf_attn": hf.config._attn_implementation,
               "hf_experts": getattr(hf.config, "_experts_implementation", None)}
    return metrics, out[:, ids.shape[1]:].tolist()


def bench_model(preset: str, num_layers: int, num_prompts: int, prompt_len: int, output_len: int,
                device: str, smoke: bool, mode: str = "kiln") -> dict:
    name = f"{preset}-{num_layers}l"
    arch = _model_arch(preset, num_layers, smoke)
    PRESETS[name] = arch  # in this process only: the loader resolves random:<name> here
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, min(arch.vocab_size, 40000), (prompt_len,), generator=g).tolist()
               for _ in range(num_prompts)]
    result = {"model": f"random:{preset} ({num_layers} of {PRESETS[preset].num_layers} layers)"
              + (" smoke" if smoke else ""),
              "requests": num_prompts, "prompt_len": prompt_len, "output_len": output_len}
    metrics, kiln_tokens, llm = _run_kiln(name, device, prompts, output_len, mode)
    result["compile_mode"] = mode
    result.update(metrics, dtype=str(next(llm.engine.executor.runner.model.parameters()).dtype))
    try:  # a transformers failure still leaves kiln's numbers in the results
        metrics, hf_tokens = _run_hf(arch, llm.engine.executor.runner.model, device, prompts, output_len)
    except Exception as e:  # noqa: BLE001
        result["hf_error"] = f"{type(e).__name__}: {e}"
        return result
    agree = [next((i for i, (a, b) in enumerate(zip(k, h)) if a != b), output_len)
             for k, h in zip(kiln_tokens, hf_tokens)]
    result.update(metrics, speedup=metrics["hf_eager_s"] / result["kiln_s"],
                  first_token_agree=sum(a > 0 for a in agree) / num_prompts,
                  mean_agree_prefix=sum(agree) / num_prompts)
    return result


def _report(result: dict, with_triton: bool, device: str) -> str:
    header = ["tokens", "reference_ms"]
    if with_triton:
        header += ["triton_ms", "speedup", "max_abs_err", "max_rel_err"]
    if device == "cuda":
        header.append("triton_graph_ms")
    kernel_table = console_table(header, [[r.get(h, "-") for h in header] for r in result["kernel"]])
    model = result["model"]
    model_keys = ["model", "requests", "prompt_len", "output_len", "kiln_tok_s", "hf_eager_tok_s", "speedup",
                  "kiln_startup_s", "first_token_agree", "mean_agree_prefix"]
    model_table = console_table(model_keys, [[model.get(k, "-") for k in model_keys]])
    errors = "".join(f"\n{k}: {v}" for k, v in {**result, **model}.items() if k.endswith("error"))
    return (f"# MoE on {result['card']}\n\nFused MoE kernel vs grouped reference, experts "
            f"{result['expert_shape']}, {result['kernel_dtype']}:\n\n```\n{kernel_table}\n```\n\n"
            f"Offline throughput, kiln (compile.mode={model.get('compile_mode', 'kiln')}, CUDA graphs) vs "
            f"transformers eager generate, "
            f"same weights:\n\n```\n{model_table}\n```\n{errors}\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--mode", default="kiln", help="kiln's compile.mode for the model run")
    ap.add_argument("--out", default=str(out_dir()))
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    with_triton = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    shape = SMOKE_EXPERTS if args.smoke else QWEN3_30B_EXPERTS
    tokens = [1, 8] if args.smoke else [1, 64, 512]
    repeats = 2 if args.smoke else args.repeats
    kernel_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    result = {"card": card, "torch": torch.__version__, "expert_shape": shape, "kernel_dtype": str(kernel_dtype),
              "kernel": [], "model": {}}
    if args.smoke:
        args.num_layers, args.num_prompts, args.prompt_len, args.output_len = 2, 3, 8, 4
    # Each part's failure is recorded and the other part still runs: the results always get written.
    for part, run in (("kernel", lambda: bench_kernel(shape, tokens, kernel_dtype, device, repeats, with_triton)),
                      ("model", lambda: bench_model("qwen1.5-moe-a2.7b", args.num_layers, args.num_prompts,
                                                    args.prompt_len, args.output_len, device, args.smoke,
                                                    args.mode))):
        try:
            result[part] = run()
        except Exception as e:  # noqa: BLE001
            result[f"{part}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    text = _report(result, with_triton, device)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "moe.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
