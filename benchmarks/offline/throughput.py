"""Does kiln (eager) keep up with Hugging Face transformers ``generate`` on the CPU?

Both run in this process, on the same weights (the SmolLM2 directory kiln's loader converted), in
float32, greedy, with the same random prompts of exactly ``--prompt-len`` tokens and exactly
``--output-len`` new tokens each (kiln: ``ignore_eos``; HF: ``min_new_tokens = max_new_tokens``).
For every batch size (1: single-request decode; 32: concurrent requests) it reports output tokens/s,
the best of ``--repeats`` timed runs after one untimed warm-up. The two systems take turns run by
run, so a burst of other work on a shared machine hits both alike rather than one of them. It also
reports how many leading greedy tokens of the first prompt agree between the two. Results: JSON +
a markdown row per system in ``$OUT`` (format: ``benchmarks.common``).

    python -m benchmarks.offline throughput                                   # the full run (a few minutes)
    python -m benchmarks.offline throughput --batch-sizes 1,4 --prompt-len 32 --output-len 8 --repeats 1
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch

from benchmarks.common import console_table, make_record, save_results, timed

# One system's generate: (prompts, new tokens each) -> the new token ids of every prompt.
Generate = Callable[[list[list[int]], int], list[list[int]]]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a registered model or a local HF directory")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated numbers of concurrent requests")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point and system; the best is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save", action="store_true", help="print only; write no results")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


def make_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (num, length), generator=gen).tolist()


def kiln_generate(llm) -> Generate:
    from kiln import SamplingParams

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return generate


def hf_generate(hf_dir: str) -> Generate:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.padding_side = "left"  # prompts share one length here; left is what batched decode needs
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @torch.inference_mode()
    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        enc = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        out = model.generate(**enc, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad_id)
        return out[:, enc["input_ids"].shape[1]:].tolist()

    return generate


def measure(systems: dict[str, Generate], prompts: list[list[int]], args) -> tuple[dict, dict]:
    """Best output tokens/s per system and batch size, and each system's tokens for prompt 0."""
    best = {name: {} for name in systems}
    first: dict[str, list[int]] = {}
    for generate in systems.values():
        generate(prompts[:1], 4)  # warm-up: first-call allocations, lazy initialisation
    for bs in args.batch_sizes:
        for _ in range(args.repeats):
            for name, generate in systems.items():
                with timed() as t:
                    outs = generate(prompts[:bs], args.output_len)
                num_tokens = sum(len(o) for o in outs)
                if num_tokens != bs * args.output_len:
                    raise RuntimeError(f"{name} made {num_tokens} tokens, wanted {bs * args.output_len}")
                best[name][bs] = max(best[name].get(bs, 0.0), num_tokens / t["s"])
                first[name] = outs[0]
        print("  batch " + str(bs) + ": " + ", ".join(f"{n} {best[n][bs]:.1f} tok/s" for n in systems), flush=True)
    return best, first


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> None:
    from kiln import LLM

    args = parse_args(argv)
    with timed() as kiln_start:
        llm = LLM(model=args.model, dtype="float32", compile={"mode": "eager"},
                  scheduler={"max_num_seqs": max(args.batch_sizes)})
    hf_dir = llm.engine.executor.runner.loaded.hf_dir
    if hf_dir is None:
        raise SystemExit(f"--model {args.model} has no Hugging Face directory to give transformers")
    with timed() as hf_start:
        hf = hf_generate(hf_dir)
    systems = {"kiln-eager": kiln_generate(llm), "hf-generate": hf}
    startup_s = {"kiln-eager": kiln_start["s"], "hf-generate": hf_start["s"]}
    prompts = make_prompts(llm.engine.executor.vocab_size, max(args.batch_sizes), args.prompt_len, args.seed)
    print(f"{args.model} ({hf_dir}): prompts of {args.prompt_len} tokens -> {args.output_len} tokens each")
    best, first = measure(systems, prompts, args)
    match = agreeing_prefix(first["kiln-eager"], first["hf-generate"])

    config = {"prompt_len": args.prompt_len, "output_len": args.output_len, "repeats": args.repeats,
              "batch_sizes": args.batch_sizes, "dtype": "float32", "num_threads": torch.get_num_threads(),
              "load_avg_1m": round(os.getloadavg()[0], 2)}  # other work on the machine skews both systems
    records = []
    for name in systems:
        metrics = {"startup_s": startup_s[name], "greedy_agreeing_tokens": match}
        for bs, tok_s in best[name].items():
            metrics[f"output_tok_s_bs{bs}"] = tok_s
            metrics[f"ms_per_step_bs{bs}"] = 1e3 * bs / tok_s  # wall time / output_len, prefill included
        records.append(make_record("throughput", args.model, {"system": name, **config}, metrics))
    rows = [[r["config"]["system"], bs, r["metrics"][f"output_tok_s_bs{bs}"], r["metrics"][f"ms_per_step_bs{bs}"]]
            for bs in args.batch_sizes for r in records]
    print(console_table(["system", "batch", "output tok/s", "ms/step"], rows))
    print(f"greedy outputs of prompt 0 agree on the first {match}/{args.output_len} tokens")
    if not args.no_save:
        keys = ["system", "prompt_len", "output_len", "load_avg_1m"]
        json_paths, table = save_results("throughput", records, config_keys=keys)
        print(f"saved {', '.join(p.name for p in json_paths)} and a row per system in {table}")


if __name__ == "__main__":
    main()
