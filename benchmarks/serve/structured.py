"""What does a JSON-schema constraint cost a batch decode, and how long does a schema take to compile?

In one process, on one engine (``--model``, default ``random:llama3-8b``, bf16, ``compile.mode=kiln``,
full CUDA graphs on a GPU):

- unconstrained: ``--batch`` requests of ``--prompt-len`` random prompt tokens, ``--max-tokens``
  greedy tokens each (``ignore_eos``), output tok/s over the whole ``generate``;
- constrained: the same batch, each request under a JSON schema (an object holding an array of at
  least ``--max-tokens`` strings, so no output can finish the JSON, and so end, before
  ``--max-tokens``: both runs produce the same number of tokens). Random weights write garbage
  inside the grammar, which is all a timing needs;
- grammar compile time per schema (xgrammar, the engine's own ``GrammarCompiler``, first compile
  and cached), for a list of schemas of increasing difficulty, and the one-time tokenizer scan.

Each run is done once to warm graphs and caches, then ``--repeats`` times, and the median timed;
then once more with the engine's host phases timed (the per-step breakdown). Results:
``$OUT/structured.json`` (or ``--out``) and a markdown table, printed last.

    python -m benchmarks.serve structured                                # GPU defaults
    python -m benchmarks.serve structured --model random:tiny --batch 4 --max-tokens 16 \\
        --dtype float32 --cudagraph none                                           # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmarks.common import out_dir

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "enum+bounds": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["colour", "score"]},
    "nested+arrays": {"type": "object", "properties": {"order": {"type": "object", "properties": {
        "id": {"type": "integer"}, "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}}}, "required": ["id", "items"]}}, "required": ["order"]},
    "refs+anyOf": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}}, "required": ["value"]}},
        "$ref": "#/$defs/node"},
}


def long_schema(min_items: int) -> dict:
    """A JSON document no output shorter than ``min_items`` tokens can complete."""
    return {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
                                                        "minItems": min_items}}, "required": ["notes"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--mode", default="kiln")
    p.add_argument("--cudagraph", default="full")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each; the median is reported")
    p.add_argument("--out", default=str(out_dir()))
    return p.parse_args(argv)


def step_breakdown(llm, prompts, params) -> dict[str, float]:
    """Mean milliseconds per engine step in each phase of one more (untimed) generate: the host
    side of a step, phase by phase. ``fill`` runs on its own thread where the runner has one."""
    engine = llm.engine
    runner = engine.executor.runner
    targets = {"step": (engine, "step"), "schedule": (engine.scheduler, "schedule"),
               "update": (engine.scheduler, "update"), "process (detokenize)": (engine, "_process"),
               "runner.launch": (runner, "launch"), "runner.collect": (runner, "collect"),
               "sampler.launch": (runner.sampler, "launch"), "bitmask fill": (runner.bitmasks, "fill")}
    totals = dict.fromkeys(targets, 0.0)
    num_steps = [0]

    def timed(name, fn):
        def wrapper(*a, **kw):
            num_steps[0] += name == "step"
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] += time.perf_counter() - t0
        return wrapper

    for name, (obj, attr) in targets.items():
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        for obj, attr in targets.values():
            delattr(obj, attr)  # the class's method again
    return {name: 1e3 * total / max(num_steps[0], 1) for name, total in totals.items()}


def timed_generate(llm, prompts, params) -> tuple[float, int, list[str]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    samples = [o.outputs[0] for o in outs]
    return elapsed, sum(len(s.token_ids) for s in samples), [s.finish_reason for s in samples]


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from kiln import LLM, SamplingParams, StructuredOutputsParams

    t_start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 64,
              compile={"mode": args.mode, "cudagraph": args.cudagraph},
              scheduler={"max_num_seqs": max(args.batch, 8)})
    build_s = time.perf_counter() - t_start
    engine = llm.engine
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rng = random.Random(0)
    vocab = min(engine.executor.vocab_size, len(engine.tokenizer))
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]

    # Grammar compile times: the tokenizer scan once, then each schema first (cold) and again (cached).
    grammars = engine.grammars
    t0 = time.perf_counter()
    grammars.compiler()
    tokenizer_scan_s = time.perf_counter() - t0
    compile_ms = {}
    for name, schema in {**SCHEMAS, "bench (long array)": long_schema(args.max_tokens)}.items():
        spec = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        grammars.compile(spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        grammars.compile(spec)
        compile_ms[name] = {"cold_ms": 1e3 * cold, "cached_ms": 1e3 * (time.perf_counter() - t0)}

    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(json=long_schema(args.max_tokens)))
    runs = {}
    for name, params in (("unconstrained", plain), ("json_schema", constrained)):
        timed_generate(llm, prompts, params)  # warm-up
        timings = [timed_generate(llm, prompts, params) for _ in range(args.repeats)]
        elapsed, num_tokens, reasons = sorted(timings)[len(timings) // 2]
        runs[name] = {"seconds": elapsed, "output_tokens": num_tokens, "tok_s": num_tokens / elapsed,
                      "all_length": all(r == "length" for r in reasons),
                      "ms_per_step": 1e3 * elapsed / args.max_tokens}
    for name, params in (("unconstrained", plain), ("json_schema", constrained)):
        runs[name]["host_ms_per_step"] = step_breakdown(llm, prompts, params)
    overhead = runs["unconstrained"]["tok_s"] / runs["json_schema"]["tok_s"] - 1
    result = {"device": device, "model": args.model, "dtype": args.dtype, "batch": args.batch,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "mode": args.mode,
              "cudagraph": args.cudagraph, "build_s": build_s, "runs": runs,
              "json_overhead_pct": 100 * overhead, "tokenizer_scan_s": tokenizer_scan_s, "compile_ms": compile_ms,
              "total_s": time.perf_counter() - t_start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(result, indent=2))
    lines = [f"{device}, {args.model} {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, "
             f"{args.max_tokens} tokens, compile.mode={args.mode}, cudagraph={args.cudagraph}", "",
             "| run | output tok/s | tokens | s | all hit max_tokens |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {k} | {v['tok_s']:.1f} | {v['output_tokens']} | {v['seconds']:.2f} | {v['all_length']} |"
              for k, v in runs.items()]
    lines += ["", "Host time per engine step, ms (one more run of each, timed phase by phase; nested phases "
              "overlap: launch holds the fill where it runs inline, collect the sampling where it runs there):", "",
              "| phase | " + " | ".join(runs) + " |", "| --- |" + " --- |" * len(runs)]
    lines += [f"| {phase} | " + " | ".join(f"{v['host_ms_per_step'][phase]:.3f}" for v in runs.values()) + " |"
              for phase in next(iter(runs.values()))["host_ms_per_step"]]
    lines += ["", f"JSON-schema overhead: {100 * overhead:+.1f}% (unconstrained tok/s over constrained)",
              f"tokenizer scan (once per engine): {tokenizer_scan_s:.2f} s", "",
              "| schema | compile ms (cold) | ms (cached) |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v['cold_ms']:.1f} | {v['cached_ms']:.3f} |" for k, v in compile_ms.items()]
    table = "\n".join(lines)
    (out / "structured.md").write_text(table + "\n")
    print(table, flush=True)


if __name__ == "__main__":
    main()
