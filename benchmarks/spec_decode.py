"""What does speculative decoding buy at batch 1, and at which batch size does it stop paying?

One process, one target model (random weights with real shapes, bf16 on the GPU), greedy decoding
of random prompts (``ignore_eos``), every number against decoding without speculation measured in
the same run:

1. baseline: no speculation, output tok/s at each batch size;
2. n-gram (prompt lookup, ``--ngram-k``) on the same engine: acceptance rate and tok/s per batch
   size. Random weights do not continue their prompt, but a random model's greedy output tends
   to fall into a loop, which prompt lookup then predicts: the acceptance is measured, not set;
3. a replay proposer (``--replay-acceptance``): proposes the baseline's own greedy continuation
   with each token swapped for a wrong one with probability 1 - acceptance, at no proposing cost:
   the speed-up the verification itself gives at a set per-token acceptance (0.7: a good n-gram
   or draft workload), independent of what random weights would repeat;
4. draft = the target itself (the ceiling: every proposal is the target's own argmax, acceptance
   about 100%, bf16 rounding aside): tok/s at batch 1 for each k in ``--ks``, then per batch size
   at ``--sweep-k``.

Speculation's own batch-size limit is lifted (``max_batch_size``) so the sweep shows where it stops
paying: the smallest batch size whose speed-up falls below 1 is the measured candidate for the
``speculative.max_batch_size`` default. Each point also records how many output tokens equal the
baseline's (greedy: identical up to bf16 ties between the verify and decode kernels).

Results: ``spec_decode.json`` (all records) and ``spec_decode.md`` under ``--out``.

    python benchmarks/spec_decode.py --out $OUT                      # H100: random:llama3-8b
    python benchmarks/spec_decode.py --smoke --out /tmp/spec         # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from common import append_table_rows, console_table, make_record


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="llama3-8b", help="random preset of the target (and of its draft)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ks", default="1,2,3,4,5", help="num_speculative_tokens at batch 1 (draft = target)")
    p.add_argument("--ngram-k", type=int, default=4)
    p.add_argument("--replay-acceptance", type=float, default=0.7)
    p.add_argument("--replay-k", type=int, default=4)
    p.add_argument("--sweep-k", type=int, default=3, help="k of the draft in the batch-size sweep")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--mode", default="kiln", help="compile.mode of target and draft")
    p.add_argument("--cudagraph", default="full_and_piecewise", help="compile.cudagraph of target and draft")
    p.add_argument("--deadline-s", type=float, default=200.0, help="start no new point after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU, random:tiny, a few tokens: checks the script runs")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.smoke:
        args.target, args.prompt_len, args.output_len = "tiny", 16, 12
        args.ks, args.batch_sizes, args.mode, args.cudagraph = "1,2", "1,2", "eager", "none"
    return args


def make_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (num, length), generator=gen).tolist()


def build(args, speculative: dict):
    from kiln import LLM

    gpu = torch.cuda.is_available() and not args.smoke
    return LLM(model=f"random:{args.target}", dtype="bfloat16" if gpu else "float32",
               device="cuda" if gpu else "cpu", max_model_len=args.prompt_len + args.output_len + 16,
               compile={"mode": args.mode, "cudagraph": args.cudagraph},
               cache={"gpu_memory_fraction": 0.8} if gpu else {"num_blocks": 256},
               scheduler={"max_num_seqs": max(int(b) for b in args.batch_sizes.split(",")),
                          "max_num_batched_tokens": 2048},
               speculative=speculative)


def set_speculation(llm, method: str, k: int, min_n: int = 2, max_n: int = 4) -> None:
    """Switch the live engine's speculation (a benchmark shortcut: the scheduler's config decides
    the lookahead slots, the runner's proposer fills them)."""
    from kiln.config import SpeculativeConfig
    from kiln.runtime.ngram_proposer import NgramProposer
    from kiln.runtime.spec_stats import SpecDecodeStats

    engine = llm.engine
    engine.scheduler.speculative = SpeculativeConfig(method=method, num_speculative_tokens=k, max_batch_size=1 << 20,
                                                     prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    if method == "ngram":
        engine.executor.runner.proposer = NgramProposer(min_n, max_n)
    engine.spec_stats = SpecDecodeStats(k)


class ReplayProposer:
    """Proposes each request's continuation from a reference run, each token wrong (id + 1) with
    probability 1 - acceptance: a proposer of set quality that costs nothing."""

    def __init__(self, reference: dict[tuple, list[int]], acceptance: float, seed: int = 0):
        self.reference, self.acceptance = reference, acceptance
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, sched) -> dict[str, list[int]]:
        drafts = {}
        for s in sched.scheduled:
            if not (s.num_lookahead_tokens and s.samples):
                continue
            done = len(s.request.output_token_ids)
            ref = self.reference[tuple(s.request.prompt_token_ids)][done:done + s.num_lookahead_tokens]
            wrong = (torch.rand(len(ref), generator=self.gen) >= self.acceptance).tolist()
            drafts[s.request.request_id] = [t + 1 if w else t for t, w in zip(ref, wrong)]
        return {rid: d for rid, d in drafts.items() if d}

    def forget(self, request_id: str) -> None:
        pass


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_point(llm, prompts, output_len: int, reference=None) -> tuple[dict, list]:
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    stats = llm.engine.spec_stats
    drafts0, proposed0, accepted0 = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
    sync()
    t0 = time.perf_counter()
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    sync()
    elapsed = time.perf_counter() - t0
    num_tokens = sum(len(o) for o in outs)
    proposed, accepted = stats.num_draft_tokens - proposed0, stats.num_accepted_tokens - accepted0
    metrics = {"output_tok_s": num_tokens / elapsed, "elapsed_s": elapsed, "batch": len(prompts),
               "acceptance_rate": accepted / proposed if proposed else None,
               "tokens_per_verify": (accepted / (stats.num_drafts - drafts0) + 1) if proposed else None}
    if reference is not None:
        same = sum(a == b for o, r in zip(outs, reference) for a, b in zip(o, r))
        metrics["same_tokens_pct"] = 100.0 * same / num_tokens
    return metrics, outs


def main(argv=None) -> None:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = make_prompts(max(batch_sizes), args.prompt_len)
    records: list[dict] = []
    t_start = time.perf_counter()

    def late() -> bool:
        return time.perf_counter() - t_start > args.deadline_s

    def record(system: str, k: int, metrics: dict, base: dict | None = None) -> None:
        if base is not None:
            metrics["speedup"] = metrics["output_tok_s"] / base["output_tok_s"]
        config = {"system": system, "k": k, "batch": metrics["batch"], "target": f"random:{args.target}",
                  "prompt_len": args.prompt_len, "output_len": args.output_len, "compile": f"{args.mode}/{args.cudagraph}"}
        records.append(make_record("spec_decode", f"random:{args.target}", config, metrics))
        print(f"[{time.perf_counter() - t_start:6.1f} s] {system} k={k} bs={metrics['batch']}: "
              f"{metrics['output_tok_s']:.1f} tok/s  acceptance={metrics.get('acceptance_rate')}  "
              f"speed-up={metrics.get('speedup')}", flush=True)
        save(records, out_dir)

    llm = build(args, {})
    baseline, reference = {}, {}
    for bs in batch_sizes:
        baseline[bs], reference[bs] = run_point(llm, prompts[:bs], args.output_len)
        record("none", 0, baseline[bs])
    set_speculation(llm, "ngram", args.ngram_k)
    for bs in batch_sizes:
        if late():
            break
        record("ngram", args.ngram_k, run_point(llm, prompts[:bs], args.output_len, reference[bs])[0], baseline[bs])
    replay = {tuple(p): r for bs in batch_sizes for p, r in zip(prompts[:bs], reference[bs])}
    set_speculation(llm, "ngram", args.replay_k)
    llm.engine.executor.runner.proposer = ReplayProposer(replay, args.replay_acceptance)
    for bs in batch_sizes:
        if late():
            break
        record(f"replay@{args.replay_acceptance}", args.replay_k,
               run_point(llm, prompts[:bs], args.output_len, reference[bs])[0], baseline[bs])
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    k_max = max(int(k) for k in args.ks.split(","))
    llm = build(args, {"method": "draft", "draft_model": f"random:{args.target}", "num_speculative_tokens": k_max,
                       "draft_compile_mode": args.mode, "draft_cudagraph": args.cudagraph})
    for k in (int(k) for k in args.ks.split(",")):
        if late():
            break
        set_speculation(llm, "draft", k)
        record("draft=target", k, run_point(llm, prompts[:1], args.output_len, reference[1])[0], baseline[1])
    set_speculation(llm, "draft", args.sweep_k)
    for bs in batch_sizes[1:]:
        if late():
            print(f"deadline ({args.deadline_s} s) passed: the remaining points were not run", flush=True)
            break
        record("draft=target", args.sweep_k, run_point(llm, prompts[:bs], args.output_len, reference[bs])[0],
               baseline[bs])
    print(console_table(["system", "k", "batch", "tok/s", "acceptance", "speed-up"],
                        [[r["config"]["system"], r["config"]["k"], r["config"]["batch"], r["metrics"]["output_tok_s"],
                          r["metrics"].get("acceptance_rate"), r["metrics"].get("speedup")] for r in records]))


def save(records: list[dict], out_dir: Path) -> None:
    (out_dir / "spec_decode.json").write_text(json.dumps(records, indent=2) + "\n")
    md = out_dir / "spec_decode.md"
    md.unlink(missing_ok=True)
    append_table_rows(md, records, ["system", "k", "batch", "target", "compile"])


if __name__ == "__main__":
    main()
