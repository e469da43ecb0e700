"""What do LoRA adapters cost: a batch mixing adapters, and batch-1 decode with one, against the base.

One process, one base model (a random preset with real shapes; bf16 on the GPU), greedy decoding of
random prompts (``ignore_eos``), every number against the base model measured in the same run:

1. ``base``: an engine without LoRA, ``--num-requests`` prompts in one ``LLM.generate``; then batch 1;
2. ``lora-engine, base requests``: an engine with ``lora.max_loras = --num-adapters`` serving the
   same prompts with no adapter (what enabling LoRA costs requests that use none);
3. ``lora, N adapters mixed``: the prompts spread round-robin over ``--num-adapters`` random PEFT
   adapters (rank ``--rank`` on every projection, non-zero B); then batch 1 with one adapter.

Each point is the best of ``--repeats`` timed runs after a warm-up. The adapters are random PEFT
directories written into a temporary directory (safetensors + adapter_config.json, peft not
needed). The LoRA engine's compiled forward reports its captures and recompiles after all points:
adapters are graph inputs, so mixing and swapping them captures nothing new.

    python -m benchmarks.offline lora                                   # GPU: random:llama3-8b
    python -m benchmarks.offline lora --model random:tiny --num-requests 8 --output-len 8 --repeats 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.common import console_table, make_record, save_results, timed_generate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point; the best is reported")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def write_adapters(model, num: int, rank: int, root: Path, seed: int) -> list[Path]:
    """``num`` random PEFT LoRA directories for ``model`` (a native kiln model), rank ``rank`` on
    every attention and MLP projection, A and B both non-zero."""
    from safetensors.torch import save_file

    from kiln.models.lora import CONFIG_FILE, TARGETS, WEIGHTS_FILE, module_shapes

    shapes = module_shapes(model)
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(num):
        tensors = {}
        for layer in range(len(model.layers)):
            for target in TARGETS:
                d_in, d_out = shapes[target]
                part = "self_attn" if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{target}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
        path = root / f"adapter{i}"
        path.mkdir()
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(path / WEIGHTS_FILE))
        (path / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                    "target_modules": list(TARGETS), "bias": "none"}))
        paths.append(path)
    return paths


def best_tok_s(llm, prompts, output_len: int, repeats: int, **kwargs) -> float:
    """Best output tokens/s of ``repeats`` timed ``LLM.generate`` runs after one warm-up."""
    timed_generate(llm, prompts, 4, **kwargs)
    return max(len(prompts) * output_len / timed_generate(llm, prompts, output_len, **kwargs)
               for _ in range(repeats))


def main(argv=None) -> None:
    from kiln import LLM, LoRARequest

    args = parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    results: dict[str, dict] = {}

    base = LLM(args.model, scheduler={"max_num_seqs": max(args.num_requests, 1)})
    vocab = base.engine.executor.vocab_size
    prompts = torch.randint(100, vocab, (args.num_requests, args.prompt_len), generator=gen).tolist()
    results["base"] = {"tok_s": best_tok_s(base, prompts, args.output_len, args.repeats),
                       "tok_s_bs1": best_tok_s(base, prompts[:1], args.batch1_output_len, args.repeats)}
    print(f"base: {results['base']}", flush=True)
    model = base.engine.executor.runner.model
    workdir = Path(tempfile.mkdtemp(prefix="kiln-lora-bench-"))
    paths = write_adapters(model, args.num_adapters, args.rank, workdir, args.seed)
    del model
    base.engine.shutdown()
    del base
    gc.collect()

    llm = LLM(args.model, scheduler={"max_num_seqs": max(args.num_requests, 1)},
              lora={"max_loras": args.num_adapters, "max_lora_rank": args.rank})
    loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    mixed = [loras[i % len(loras)] for i in range(len(prompts))]
    results["lora-engine-base-requests"] = {
        "tok_s": best_tok_s(llm, prompts, args.output_len, args.repeats),
        "tok_s_bs1": best_tok_s(llm, prompts[:1], args.batch1_output_len, args.repeats)}
    print(f"lora engine, base requests: {results['lora-engine-base-requests']}", flush=True)
    results[f"lora-{args.num_adapters}-mixed"] = {
        "tok_s": best_tok_s(llm, prompts, args.output_len, args.repeats, lora_request=mixed),
        "tok_s_bs1": best_tok_s(llm, prompts[:1], args.batch1_output_len, args.repeats, lora_request=loras[:1])}
    print(f"lora, adapters mixed: {results[f'lora-{args.num_adapters}-mixed']}", flush=True)
    forward = getattr(getattr(llm.engine.executor.runner, "compiled", None), "forward", None)
    graphs = ({"num_captures": forward.num_captures, "num_recompiles": forward.num_recompiles}
              if forward is not None and hasattr(forward, "num_captures") else {})
    llm.engine.shutdown()

    base_tok_s, base_bs1 = results["base"]["tok_s"], results["base"]["tok_s_bs1"]
    config = {"num_requests": args.num_requests, "num_adapters": args.num_adapters, "rank": args.rank,
              "prompt_len": args.prompt_len, "output_len": args.output_len,
              "batch1_output_len": args.batch1_output_len, "repeats": args.repeats}
    records, rows = [], []
    for system, r in results.items():
        metrics = {"output_tok_s": r["tok_s"], "vs_base": r["tok_s"] / base_tok_s,
                   "output_tok_s_bs1": r["tok_s_bs1"], "bs1_vs_base": r["tok_s_bs1"] / base_bs1}
        if system != "base":
            metrics.update(graphs)
        records.append(make_record("lora", args.model, {"system": system, **config}, metrics))
        rows.append([system, r["tok_s"], metrics["vs_base"], r["tok_s_bs1"], metrics["bs1_vs_base"]])
    print(console_table(["system", f"tok/s ({args.num_requests} req)", "vs base", "tok/s batch 1", "vs base"], rows))
    if graphs:
        print(f"LoRA engine's compiled forward: {graphs['num_captures']} capture(s), "
              f"{graphs['num_recompiles']} recompile(s)")
    save_results("lora", records, config_keys=["system", "num_requests", "num_adapters", "rank"])


if __name__ == "__main__":
    main()
