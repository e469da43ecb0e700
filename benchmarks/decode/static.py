"""Batch-1 decode: kiln against a plain static-cache ``torch.compile`` decode, in one process.

The baseline is what a user writes first for fast batch-1 decode: one function, the whole decode
step over a static (non-paged) KV cache ``[layers, 1, kv_heads, max_len, head_dim]``, attention by
``F.scaled_dot_product_attention`` over the whole cache with a causal mask, the argmax inside,
compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (Inductor + CUDA graphs).
It uses the very tensors of kiln's ``random:<preset>`` model (seed 0: the same random weights kiln
loads) and kiln's RoPE and norms, so both greedy token streams must agree.

For each model: the device copy bandwidth (the roofline: weight bytes per step / bandwidth), the
baseline's ms per decode step, then kiln through its public API (``LLM(model=...)`` with the
defaults unless ``--kiln-config`` says otherwise), measured as ``gpu_decode.py`` does (prompt
``--prompt-len``, ``--output-len`` new tokens, step = (t(n) - t(1)) / (n - 1)). Printed: tok/s,
ms/step, % of roofline, kiln over baseline; written: ``static_decode-<card>.json`` and ``.md``.

    python -m benchmarks.decode static --out $OUT
    python -m benchmarks.decode static --models qwen2.5-0.5b --kiln-config '{"compile": {"mode": "kiln"}}'
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import append_table_rows, console_table, make_record, out_dir
from benchmarks.decode.gpu import agreeing_prefix, copy_bandwidth, decode_metrics, make_prompts, weight_bytes_per_step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2.5-0.5b,llama3-8b", help="random presets")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kiln-config", action="append", default=None,
                   help="JSON of LLM keyword groups for one kiln run (repeatable); default: one run, no options")
    p.add_argument("--max-model-len", type=int, default=2048, help="kiln's max_model_len")
    p.add_argument("--wide-splits", action="store_true",
                   help="also run kiln with the earlier decode split policy inside graphs (256-key splits)")
    p.add_argument("--throughput", type=int, default=0,
                   help="also offline throughput with each kiln config: this many prompts of 256 in / 256 out")
    p.add_argument("--throughput-models", default="llama3-8b", help="presets that run --throughput")
    p.add_argument("--out", default=str(out_dir()))
    return p.parse_args(argv)


# ---- the baseline ------------------------------------------------------------------------------------


class StaticCacheDecoder:
    """Greedy decode of kiln's ``LlamaForCausalLM`` weights over a static KV cache."""

    def __init__(self, model, max_len: int):
        arch = model.arch
        self.model, self.max_len = model, max_len
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        param = next(model.parameters())
        shape = (arch.num_layers, 1, arch.num_kv_heads, max_len, arch.head_dim)
        self.k_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.v_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)
        for cache in (self.k_cache, self.v_cache):  # mutated in the graph: CUDA graphs need them static
            torch._dynamo.mark_static_address(cache)
        self.decode = torch.compile(self.forward, mode="reduce-overhead", fullgraph=True)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids, pos: [T] -> the greedy next token after the last one, [1] int64."""
        from kiln.models.llama import apply_rope

        m, h, kvh, d = self.model, self.num_heads, self.num_kv_heads, self.head_dim
        x = m.embed_tokens(ids)  # [T, hidden]
        cos_sin = m.cos_sin_cache.index_select(0, pos).to(x.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        cos, sin_signed = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        mask = torch.arange(self.max_len, device=ids.device)[None, :] <= pos[:, None]  # [T, max_len]
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            qkv = attn.qkv_proj(layer.input_layernorm(x))
            qk, v = qkv.split([attn.q_size + attn.kv_size, attn.kv_size], dim=-1)
            qk = apply_rope(qk.view(-1, h + kvh, d), cos, sin_signed)
            q, k = qk.split([h, kvh], dim=1)
            self.k_cache[i, 0].index_copy_(1, pos, k.transpose(0, 1))
            self.v_cache[i, 0].index_copy_(1, pos, v.view(-1, kvh, d).transpose(0, 1))
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), self.k_cache[i], self.v_cache[i],
                                               attn_mask=mask, scale=attn.scale, enable_gqa=True)
            x = x + attn.o_proj(o[0].transpose(0, 1).flatten(1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.compute_logits(m.norm(x[-1:])).argmax(-1)

    @torch.inference_mode()
    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        dev = self.k_cache.device
        ids = torch.tensor(prompt, device=dev)
        tok = self.forward(ids, torch.arange(len(prompt), device=dev))  # prefill, eager
        out = [tok]
        for p in range(len(prompt), len(prompt) + new_tokens - 1):
            tok = self.decode(tok, torch.tensor([p], device=dev)).clone()
            out.append(tok)
        return torch.cat(out).tolist()


def baseline_metrics(decoder: StaticCacheDecoder, args, roofline_tok_s: float) -> tuple[dict, list[int]]:
    prompt = make_prompts(1, args.prompt_len)[0]
    t0 = time.perf_counter()
    decoder.generate(prompt, 8)  # compiles, records the CUDA graph
    compile_s = time.perf_counter() - t0
    times = {}
    for n in (1, args.output_len):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens = decoder.generate(prompt, n)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        times[n] = best
    step_s = (times[args.output_len] - times[1]) / (args.output_len - 1)
    return {"output_tok_s": args.output_len / times[args.output_len], "decode_step_ms": 1e3 * step_s,
            "decode_tok_s": 1 / step_s, "roofline_pct": 100 / step_s / roofline_tok_s,
            "compile_s": compile_s}, tokens


# ---- the run ---------------------------------------------------------------------------------------


def run_model(preset: str, args, bandwidth: float, records: list) -> None:
    from kiln import LLM, SamplingParams
    from kiln.models.arch import PRESETS
    from kiln.models.loader import build_empty_model, init_random_weights

    model = build_empty_model(PRESETS[preset], torch.device("cuda"), torch.bfloat16)
    init_random_weights(model, seed=0)
    roofline = bandwidth / weight_bytes_per_step(model)
    name = f"random:{preset}"
    decoder = StaticCacheDecoder(model, max_len=-(-(args.prompt_len + args.output_len) // 64) * 64)
    base, base_tokens = baseline_metrics(decoder, args, roofline)
    base["roofline_tok_s"] = roofline
    records.append(make_record("static_decode", name, {"system": "static-torch.compile-reduce-overhead",
                                                       "batch": 1}, base))
    print(f"  {name} baseline: {base['decode_tok_s']:.1f} tok/s, {base['decode_step_ms']:.3f} ms/step, "
          f"{base['roofline_pct']:.1f}% of roofline", flush=True)
    del decoder, model
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()

    from kiln.ops import triton_attention

    runs = [(raw, None) for raw in (args.kiln_config or ["{}"])]
    if args.wide_splits:  # the policy before static_min_split_tokens: as wide as outside graphs
        runs.append(((args.kiln_config or ["{}"])[0], "wide-splits"))
    default_cfg = triton_attention.attend_paged_cached.__defaults__
    for i, (raw, variant) in enumerate(runs):
        groups = json.loads(raw)
        if variant == "wide-splits":
            triton_attention.attend_paged_cached.__defaults__ = (triton_attention.LaunchConfig(
                static_min_split_tokens=triton_attention.LaunchConfig().min_split_tokens),)
        t0 = time.perf_counter()
        try:
            llm = LLM(model=name, max_model_len=args.max_model_len, **groups)
        finally:
            triton_attention.attend_paged_cached.__defaults__ = default_cfg  # graphs keep what they captured
        startup_s = time.perf_counter() - t0
        if variant == "wide-splits":
            raw = raw + " wide-splits"

        def generate(prompts, new_tokens):
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

        metrics, tokens = decode_metrics(generate, args, roofline)
        metrics.update(startup_s=startup_s, roofline_tok_s=roofline,
                       over_baseline=base["decode_step_ms"] / metrics["decode_step_ms"],
                       agree_with_baseline_tokens=agreeing_prefix(tokens, base_tokens))
        resolved = llm.engine.config
        config = {"system": "kiln", "batch": 1, "options": raw, "mode": resolved.compile.mode,
                  "cudagraph": resolved.compile.cudagraph, "max_num_seqs": resolved.scheduler.max_num_seqs}
        records.append(make_record("static_decode", name, config, metrics))
        print(f"  {name} kiln {raw}: {metrics['decode_tok_s']:.1f} tok/s, {metrics['decode_step_ms']:.3f} ms/step, "
              f"{metrics['roofline_pct']:.1f}% of roofline, {metrics['over_baseline']:.3f}x baseline, "
              f"tokens agree for {metrics['agree_with_baseline_tokens']}", flush=True)
        if args.throughput and preset in args.throughput_models.split(",") and variant is None:
            prompts = make_prompts(args.throughput, 256, seed=1)
            generate(prompts[:4], 4)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(prompts, 256)
            elapsed = time.perf_counter() - t0
            records.append(make_record("static_decode", name, {**config, "system": "kiln-offline",
                                                               "batch": args.throughput},
                                       {"output_tok_s": args.throughput * 256 / elapsed, "elapsed_s": elapsed}))
            print(f"  {name} kiln offline {args.throughput} x 256/256: {args.throughput * 256 / elapsed:.0f} tok/s",
                  flush=True)
        llm.engine.shutdown()
        del llm, generate
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    card = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"{card}: device copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    records = [make_record("static_decode", "-", {"system": "device-copy", "batch": 0},
                           {"bandwidth_tb_s": bandwidth / 1e12})]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "static_decode-" + "".join(c if c.isalnum() else "_" for c in card).strip("_")
    for preset in args.models.split(","):
        try:
            run_model(preset, args, bandwidth, records)
        except Exception as e:  # record and go on
            import traceback

            traceback.print_exc()
            records.append(make_record("static_decode", f"random:{preset}", {"system": "error"},
                                       status="error", error=f"{type(e).__name__}: {e}"))
        (out / f"{stem}.json").write_text(json.dumps(records, indent=1))
    md = out / f"{stem}.md"
    if md.exists():
        md.unlink()
    append_table_rows(md, records, ["system", "batch", "options"])
    rows = [[r["model"], r["config"].get("system"), r["config"].get("options", ""),
             r["metrics"].get("decode_tok_s", r["metrics"].get("output_tok_s", r["metrics"].get("bandwidth_tb_s"))),
             r["metrics"].get("decode_step_ms", ""), r["metrics"].get("roofline_pct", ""),
             r["metrics"].get("over_baseline", "")]
            for r in records if r["status"] == "ok"]
    print(console_table(["model", "system", "options", "tok/s", "ms/step", "% roofline", "x baseline"], rows))


if __name__ == "__main__":
    main()
