"""Generic path vs native path: transformers' own modeling code captured by kiln against kiln's model.

For each model and each ``model.impl`` (``native``: kiln's Llama-family code; ``transformers``: the
generic path, the transformers model of the same config with the same random weights), in one
process, one after the other, with the same ``compile.mode`` and CUDA graphs:

- start-up (engine build: weights, capture + Inductor, KV cache, CUDA graphs),
- batch 1: one prompt of ``--prompt-len`` tokens, ``--output-len`` new tokens (ignore_eos), best of
  ``--repeats`` after a warm-up; reported as decode tok/s (the prefill-only time subtracted) and
  end-to-end output tok/s,
- offline: ``--num-requests`` prompts of ``--prompt-len`` submitted together, ``--output-len`` new
  tokens each; output tok/s, best of two runs (the first may compile kernels for new shapes),

and the ratio generic / native of each, plus how many of the batch-1 greedy tokens the two paths
agree on (same weights; bf16 rounding differs between the two codes, so late tokens may part).
Prints a table and writes ``generic_vs_native.json`` (and ``.md``) under ``--out`` (default
``$OUT``).

    # on one GPU (each line well under 4 minutes on an H100):
    python -m benchmarks.offline generic-vs-native --models random:qwen2.5-0.5b
    python -m benchmarks.offline generic-vs-native --models random:llama3-8b --num-requests 128
    # CPU smoke run at a tiny size:
    python -m benchmarks.offline generic-vs-native --models random:tiny --mode eager --prompt-len 16 \\
        --output-len 8 --num-requests 4 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from kiln import LLM, SamplingParams

from benchmarks.common import out_dir


def _prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (num, length), generator=g).tolist()  # no special tokens


def _generate(llm: LLM, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == max_tokens for t in tokens)
    return elapsed, tokens


def bench_one(model: str, impl: str, args) -> tuple[dict, list[int]]:
    kwargs = {}
    if args.kv_cache_gib:
        kwargs["cache"] = {"kv_cache_memory_gib": args.kv_cache_gib}
    t0 = time.perf_counter()
    llm = LLM(model, impl=impl, dtype=args.dtype, compile={"mode": args.mode, "cudagraph": args.cudagraph},
              scheduler={"max_num_seqs": args.max_num_seqs}, **kwargs)
    startup_s = time.perf_counter() - t0
    runner = llm.engine.executor.runner
    vocab = runner.arch.vocab_size
    one = _prompts(vocab, 1, args.prompt_len, seed=1)
    _generate(llm, _prompts(vocab, 2, args.prompt_len, seed=2), 4)  # warm-up
    prefill_s = min(_generate(llm, one, 1)[0] for _ in range(args.repeats))
    runs = [_generate(llm, one, args.output_len) for _ in range(args.repeats)]
    full_s, tokens = min(runs, key=lambda r: r[0])
    offline = _prompts(vocab, args.num_requests, args.prompt_len, seed=3)
    # Best of two: the first run of a batch shape may compile kernels for it (Triton specializations),
    # which would favour whichever engine runs second in this process.
    offline_s = min(_generate(llm, offline, args.output_len)[0] for _ in range(2))
    row = {
        "model": model,
        "impl": impl,
        "model_class": type(runner.model).__name__,
        "startup_s": round(startup_s, 2),
        "bs1_decode_tok_s": round((args.output_len - 1) / max(full_s - prefill_s, 1e-9), 2),
        "bs1_e2e_tok_s": round(args.output_len / full_s, 2),
        "offline_out_tok_s": round(args.num_requests * args.output_len / offline_s, 2),
        "offline_s": round(offline_s, 2),
        "startup_phases_s": {k: round(v, 2) for k, v in runner.startup_seconds.items()},
    }
    llm.engine.shutdown()
    del llm, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, tokens[0]


def _leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="random:qwen2.5-0.5b,random:llama3-8b")
    p.add_argument("--impls", default="native,transformers")
    p.add_argument("--mode", default="kiln", help="compile.mode")
    p.add_argument("--cudagraph", default=None, help="compile.cudagraph; default full_and_piecewise on CUDA, "
                   "none elsewhere")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=256, help="offline: prompts submitted together")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="cache.kv_cache_memory_gib; default 12 on CUDA (both engines of a model fit in turn)")
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.cudagraph is None:
        args.cudagraph = "full_and_piecewise" if cuda else "none"
    if args.kv_cache_gib is None and cuda:
        args.kv_cache_gib = 12.0
    device = torch.cuda.get_device_name() if cuda else "cpu"
    rows, comparisons = [], []
    for model in args.models.split(","):
        tokens = {}
        for impl in args.impls.split(","):
            row, tokens[impl] = bench_one(model, impl, args)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "startup_phases_s"}), flush=True)
        if {"native", "transformers"} <= set(tokens):
            nat = next(r for r in rows if r["model"] == model and r["impl"] == "native")
            gen = next(r for r in rows if r["model"] == model and r["impl"] == "transformers")
            comparisons.append({
                "model": model,
                **{f"{k}_generic_over_native": round(gen[k] / nat[k], 3)
                   for k in ("bs1_decode_tok_s", "bs1_e2e_tok_s", "offline_out_tok_s")},
                "bs1_greedy_tokens_agreeing": _leading_agreement(tokens["native"], tokens["transformers"]),
                "of": args.output_len,
            })
    meta = {"device": device, "mode": args.mode, "cudagraph": args.cudagraph, "dtype": args.dtype,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "num_requests": args.num_requests,
            "torch": torch.__version__}
    keys = ["model", "impl", "startup_s", "bs1_decode_tok_s", "bs1_e2e_tok_s", "offline_out_tok_s"]
    lines = [f"# generic (transformers) vs native on {device}", "",
             f"compile.mode={args.mode}, cudagraph={args.cudagraph}, dtype={args.dtype}; batch 1: prompt "
             f"{args.prompt_len} + {args.output_len} new; offline: {args.num_requests} x "
             f"{args.prompt_len}/{args.output_len}; torch {torch.__version__}", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    if comparisons:
        ckeys = list(comparisons[0])
        lines += ["", "| " + " | ".join(ckeys) + " |", "|" + "---|" * len(ckeys)]
        lines += ["| " + " | ".join(str(c[k]) for k in ckeys) + " |" for c in comparisons]
    md = "\n".join(lines) + "\n"
    print(md)
    os.makedirs(args.out, exist_ok=True)
    result = {"meta": meta, "rows": rows, "generic_over_native": comparisons}
    with open(os.path.join(args.out, "generic_vs_native.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "generic_vs_native.md"), "w") as f:
        f.write(md)
    return result


if __name__ == "__main__":
    main()
