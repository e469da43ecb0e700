"""What does speculative decoding buy at batch 1, and at which batch size does it stop paying?

One process, one target model (random weights with real shapes, bf16 on the GPU), greedy decoding
of random prompts (``ignore_eos``), every number against decoding without speculation measured in
the same run, on an engine whose verify steps (k + 1 tokens a request) replay full CUDA graphs:

1. baseline: no speculation, output tok/s at each batch size;
2. verify cost: a proposer that is always wrong (acceptance 0): every step verifies k tokens and
   emits one, so its tok/s against the baseline is what verification costs. Its outputs are the
   reference of the next point: tokens emitted by verify steps of the same shape;
3. a replay proposer of set per-token acceptance ``alpha`` (``--alphas``): it proposes the
   reference's continuation, each token wrong (id + 1) where a fixed draw per (prompt, position)
   is >= alpha, at no proposing cost: the speed-up verification gives at that acceptance. Random
   weights in bf16 have logits so flat that the decode and verify kernels' rounding picks a
   different argmax every few tokens, so a reference from plain decoding diverges at once; one from
   verify steps of the same shape does not (a row's result does not depend on the other rows);
4. n-gram (prompt lookup) on the same engine over random prompts: what the real proposer costs when
   it finds nothing to propose (random weights do not repeat their prompt);
5. draft = the target itself (acceptance about 100%, bf16 rounding aside), with its own full graphs
   and tokens kept on the device: tok/s at batch 1 for each k in ``--ks``, then per batch size.

The acceptance an n-gram proposer gets on text that repeats its prompt is measured with the real
SmolLM2 on the CPU (``--workload repeat``; the embedded model does not fit the device's transfer):
acceptance rate, tokens per verify step and tok/s against no speculation.

Speculation's own batch-size limit is lifted (``max_batch_size``) so the sweep shows where it stops
paying. Each point records how many output tokens equal its reference, the fraction of verify steps
that replayed a full graph, and (``--check-fp32``) greedy tokens with and without speculation are
compared on a float32 model, where kernel rounding does not flip argmaxes.

Results: ``spec_decode.json`` (all records) and ``spec_decode.md`` under ``--out``.

    python -m benchmarks.offline spec-decode --out $OUT                      # H100: random:llama3-8b
    python -m benchmarks.offline spec-decode --workload repeat --out /tmp/spec   # CPU: SmolLM2 n-gram acceptance
    python -m benchmarks.offline spec-decode --smoke --out /tmp/spec         # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

from benchmarks.common import append_table_rows, console_table, make_record, out_dir


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="random", choices=["random", "repeat"])
    p.add_argument("--target", default="llama3-8b", help="random preset of the target (and of its draft)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the n-gram and replay points")
    p.add_argument("--alphas", default="0.7,0.9,1.0", help="per-token acceptance of the replay proposer")
    p.add_argument("--ks", default="1,3,5", help="num_speculative_tokens at batch 1 (draft = target)")
    p.add_argument("--sweep-k", type=int, default=3, help="k of the draft in the batch-size sweep")
    p.add_argument("--batch-sizes", default="1,4,8,16,32")
    p.add_argument("--draft-batch-sizes", default="8,32")
    p.add_argument("--mode", default="kiln", help="compile.mode of target and draft")
    p.add_argument("--cudagraph", default="full_and_piecewise", help="compile.cudagraph of target and draft")
    p.add_argument("--check-fp32", default="qwen2.5-0.5b", help="random preset for the float32 token check ('' skips)")
    p.add_argument("--deadline-s", type=float, default=280.0, help="start no new point after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU, random:tiny, a few tokens: checks the script runs")
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)
    if args.smoke:
        args.target, args.prompt_len, args.output_len, args.check_fp32 = "tiny", 16, 12, "tiny"
        args.ks, args.batch_sizes, args.draft_batch_sizes = "1,2", "1,2", "2"
        args.mode, args.cudagraph = "eager", "none"
    return args


def make_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (num, length), generator=gen).tolist()


def on_gpu(args) -> bool:
    return torch.cuda.is_available() and not args.smoke


def build(args, speculative: dict, model: str = "", dtype: str = "bfloat16", mode: str = ""):
    """An engine of the target (``model``), compiled with ``mode`` (default ``--mode``, with
    ``--cudagraph``; ``eager``: with full graphs only, nothing to compile)."""
    from kiln import LLM

    gpu = on_gpu(args)
    mode = mode or args.mode
    cudagraph = args.cudagraph if mode == args.mode or not gpu else "full"
    if speculative.get("method") == "draft":
        speculative = {"draft_compile_mode": mode, "draft_cudagraph": cudagraph, **speculative}
    max_batch = max(int(b) for b in args.batch_sizes.split(","))
    return LLM(model=model or f"random:{args.target}", dtype=dtype if gpu else "float32",
               device="cuda" if gpu else "cpu", max_model_len=args.prompt_len + args.output_len + 16,
               compile={"mode": mode, "cudagraph": cudagraph, "capture_sizes": (1, 2, 4, 8, 16, 24, 32)},
               cache={"gpu_memory_fraction": 0.8} if gpu else {"num_blocks": 256},
               scheduler={"max_num_seqs": max_batch, "max_num_batched_tokens": 2048},
               speculative={"max_batch_size": max_batch, **speculative})


def set_speculation(llm, on: bool, proposer=None) -> None:
    """Switch the live engine's speculation on or off (a benchmark shortcut: the scheduler's config
    decides the lookahead slots, the runner's proposer fills them), keeping the k its verify
    graphs were captured for; counters start over."""
    import dataclasses

    from kiln.runtime.spec_stats import SpecDecodeStats

    engine = llm.engine
    spec = engine.config.speculative  # as built: the method and k its verify graphs are for
    engine.scheduler.speculative = spec if on else dataclasses.replace(spec, method="none")
    if proposer is not None:
        engine.executor.runner.proposer = proposer
    engine.spec_stats = SpecDecodeStats(spec.num_speculative_tokens)


class ReplayProposer:
    """Proposes each request's continuation from a reference run (``None``: token 0, wrong almost
    surely); the token at output position i is wrong (id + 1) where a fixed draw for (prompt, i) is
    >= alpha, so the proposals depend on the reference alone, not on how steps fall."""

    def __init__(self, reference: dict[tuple, list[int]] | None, alpha: float):
        self.reference, self.alpha = reference, alpha
        self._wrong: dict[tuple, list[bool]] = {}

    def propose(self, sched) -> dict[str, list[int]]:
        drafts = {}
        for s in sched.scheduled:
            n = s.num_lookahead_tokens
            if not (n and s.samples):
                continue
            key, done = tuple(s.request.prompt_token_ids), len(s.request.output_token_ids)
            if self.reference is None:
                drafts[s.request.request_id] = [0] * n
                continue
            if key not in self._wrong:
                draw = random.Random(hash(key))
                self._wrong[key] = [draw.random() >= self.alpha for _ in range(len(self.reference[key]) + 64)]
            ref, wrong = self.reference[key][done:done + n], self._wrong[key][done:done + n]
            drafts[s.request.request_id] = [t + 1 if w else t for t, w in zip(ref, wrong)]
        return {rid: d for rid, d in drafts.items() if d}

    def forget(self, request_id: str) -> None:
        pass


class GraphCounter:
    """Counts the target's and draft's verify-shaped steps (k + 1 tokens a request, k > 0) and how
    many of them replayed a full graph, by wrapping the compiled model's dispatch."""

    def __init__(self):
        import kiln.compiler.graph_sets as graph_sets
        from kiln.compiler.cudagraph import GraphMode

        self.verify_steps = self.full_steps = 0
        inner = graph_sets.dispatch

        def counting(full, piecewise, num_tokens, num_reqs, num_decodes, verify=None, query_len=0):
            mode, padded = inner(full, piecewise, num_tokens, num_reqs, num_decodes, verify, query_len)
            if num_tokens > num_reqs and query_len > 1:
                self.verify_steps += 1
                self.full_steps += mode is GraphMode.FULL
            return mode, padded

        graph_sets.dispatch = counting

    def take(self) -> float | None:
        pct = 100.0 * self.full_steps / self.verify_steps if self.verify_steps else None
        self.verify_steps = self.full_steps = 0
        return pct


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_point(llm, prompts, output_len: int, reference=None, counter: GraphCounter | None = None) -> tuple[dict, list]:
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    stats = llm.engine.spec_stats
    drafts0, proposed0, accepted0 = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
    if counter is not None:
        counter.take()
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
    if counter is not None:
        metrics["verify_steps_in_full_graphs_pct"] = counter.take()
    if reference is not None:
        same = sum(a == b for o, r in zip(outs, reference) for a, b in zip(o, r))
        metrics["same_tokens_pct"] = 100.0 * same / num_tokens
    return metrics, outs


class Recorder:
    def __init__(self, args, out_dir: Path):
        self.args, self.out_dir, self.records, self.t_start = args, out_dir, [], time.perf_counter()

    def late(self) -> bool:
        return time.perf_counter() - self.t_start > self.args.deadline_s

    def __call__(self, system: str, k: int, metrics: dict, base: dict | None = None, model: str = "") -> None:
        args = self.args
        model = model or f"random:{args.target}"
        if base is not None:
            metrics["speedup"] = metrics["output_tok_s"] / base["output_tok_s"]
        config = {"system": system, "k": k, "batch": metrics["batch"], "target": model,
                  "prompt_len": args.prompt_len, "output_len": args.output_len,
                  "compile": f"{args.mode}/{args.cudagraph}"}
        self.records.append(make_record("spec_decode", model, config, metrics))
        print(f"[{time.perf_counter() - self.t_start:6.1f} s] {system} k={k} bs={metrics['batch']}: "
              f"{metrics['output_tok_s']:.1f} tok/s  acceptance={metrics.get('acceptance_rate')}  "
              f"speed-up={metrics.get('speedup')}  same={metrics.get('same_tokens_pct')}  "
              f"full={metrics.get('verify_steps_in_full_graphs_pct')}", flush=True)
        save(self.records, self.out_dir)

    def table(self) -> str:
        return console_table(
            ["system", "k", "batch", "tok/s", "acceptance", "tok/verify", "speed-up", "same %", "full %"],
            [[r["config"]["system"], r["config"]["k"], r["config"]["batch"], r["metrics"]["output_tok_s"],
              r["metrics"].get("acceptance_rate"), r["metrics"].get("tokens_per_verify"), r["metrics"].get("speedup"),
              r["metrics"].get("same_tokens_pct"), r["metrics"].get("verify_steps_in_full_graphs_pct")]
             for r in self.records])


def target_points(args, record: Recorder, counter: GraphCounter, prompts, batch_sizes) -> dict:
    """Points 1-4 on one engine (verify graphs for k = args.k); returns the baseline per batch size."""
    llm = build(args, {"method": "ngram", "num_speculative_tokens": args.k})
    baseline, verify_ref = {}, {}
    set_speculation(llm, False)
    for bs in batch_sizes:
        baseline[bs], _ = run_point(llm, prompts[:bs], args.output_len)
        record("none", 0, baseline[bs])
    set_speculation(llm, True, ReplayProposer(None, 0.0))
    for bs in batch_sizes:
        metrics, verify_ref[bs] = run_point(llm, prompts[:bs], args.output_len, counter=counter)
        record("always-wrong (verify cost)", args.k, metrics, baseline[bs])
    alphas = [float(a) for a in args.alphas.split(",")]
    for alpha in alphas:
        for bs in batch_sizes if alpha == alphas[0] else batch_sizes[:1]:  # the first alpha: every batch size
            if record.late():
                break
            # The reference of this batch size: rounding depends on the batch a token is verified in.
            set_speculation(llm, True, ReplayProposer(dict(zip(map(tuple, prompts[:bs]), verify_ref[bs])), alpha))
            record(f"replay alpha={alpha}", args.k,
                   run_point(llm, prompts[:bs], args.output_len, verify_ref[bs], counter)[0], baseline[bs])
    from kiln.runtime.ngram_proposer import NgramProposer

    set_speculation(llm, True, NgramProposer(2, 4))
    for bs in batch_sizes:
        if not record.late():
            record("ngram (random prompts)", args.k, run_point(llm, prompts[:bs], args.output_len, None, counter)[0],
                   baseline[bs])
    del llm
    free_memory()
    return baseline


def draft_points(args, record: Recorder, counter: GraphCounter, prompts, baseline: dict) -> None:
    """Point 5: draft = target, one engine per k (its verify graphs are captured for k + 1 tokens)."""
    points = [(int(k), 1) for k in args.ks.split(",")]
    points += [(args.sweep_k, int(b)) for b in args.draft_batch_sizes.split(",") if int(b) in baseline]
    for k in sorted({k for k, _ in points}):
        if record.late():
            print(f"deadline ({args.deadline_s} s) passed: the remaining points were not run", flush=True)
            return
        llm = build(args, {"method": "draft", "draft_model": f"random:{args.target}", "num_speculative_tokens": k})
        for kk, bs in points:
            if kk == k and not record.late():
                record("draft=target", k, run_point(llm, prompts[:bs], args.output_len, None, counter)[0], baseline[bs])
        del llm
        free_memory()


def fp32_check(args, record: Recorder, counter: GraphCounter) -> None:
    """Greedy tokens with and without speculation (replay of the plain run at alpha 0.7, n-gram,
    draft = target) on a float32 model, where the kernels' rounding does not flip argmaxes."""
    model = f"random:{args.check_fp32}"
    prompts = make_prompts(8, args.prompt_len, seed=1)
    llm = build(args, {"method": "ngram", "num_speculative_tokens": args.k}, model, "float32", "eager")
    set_speculation(llm, False)
    base, ref = run_point(llm, prompts, args.output_len)
    record("fp32: none", 0, base, model=model)
    set_speculation(llm, True, ReplayProposer({tuple(p): r for p, r in zip(prompts, ref)}, 0.7))
    record("fp32: replay alpha=0.7", args.k, run_point(llm, prompts, args.output_len, ref, counter)[0], base, model)
    del llm
    free_memory()
    llm = build(args, {"method": "draft", "draft_model": model, "num_speculative_tokens": 3}, model, "float32", "eager")
    record("fp32: draft=target", 3, run_point(llm, prompts, args.output_len, ref, counter)[0], base, model)
    del llm
    free_memory()


REPEAT_TEXTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold, and not all those who wander are lost.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It takes place mainly in the leaves, inside the chloroplasts.",
    "To reset your password, open the settings page, choose Account, then Security, and press the button "
    "labelled Reset password. A link will be sent to the email address on file.",
]


def repeat_workload(args, record: Recorder) -> None:
    """N-gram acceptance on text that repeats its prompt, with the real SmolLM2: a chat asking to
    repeat a passage word for word; batch sizes 1 and all prompts, against no speculation."""
    from kiln import LLM, SamplingParams

    model = "smollm2-135m-instruct"
    args.mode = args.cudagraph = "auto"  # the engines below take the device's defaults (recorded as such)
    chats = [[{"role": "user", "content": f"Repeat the following text exactly, word for word.\n\n{t}"}]
             for t in REPEAT_TEXTS]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    baseline, reference = {}, {}
    for k in (0, args.k):
        spec = {"method": "ngram", "num_speculative_tokens": k} if k else {}
        llm = LLM(model, speculative={"max_batch_size": 64, **spec})
        for bs in (1, len(chats)):
            llm.chat(chats[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
            set_speculation(llm, bool(k))  # counters start over
            t0 = time.perf_counter()
            outs = [o.outputs[0].token_ids for o in llm.chat(chats[:bs], params, use_tqdm=False)]
            elapsed = time.perf_counter() - t0
            stats = llm.engine.spec_stats
            metrics = {"output_tok_s": sum(map(len, outs)) / elapsed, "batch": bs, "elapsed_s": elapsed,
                       "acceptance_rate": stats.acceptance_rate if k else None,
                       "tokens_per_verify": (stats.num_accepted_tokens / stats.num_drafts + 1
                                             if stats.num_drafts else None)}
            if not k:
                baseline[bs], reference[bs] = metrics, outs
            else:
                same = sum(a == b for o, r in zip(outs, reference[bs]) for a, b in zip(o, r))
                metrics["same_tokens_pct"] = 100.0 * same / max(1, sum(map(len, outs)))
            system = f"{'ngram' if k else 'none'} (repeat the prompt, CPU)"
            record(system, k, metrics, baseline[bs] if k else None, model)
        del llm
        free_memory()


def free_memory() -> None:
    """After the caller dropped its engine: collect its reference cycles and give the memory back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = Recorder(args, out_dir)
    if args.workload == "repeat":
        repeat_workload(args, record)
    else:
        counter = GraphCounter()
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        prompts = make_prompts(max(batch_sizes), args.prompt_len)
        baseline = target_points(args, record, counter, prompts, batch_sizes)
        if args.check_fp32:
            fp32_check(args, record, counter)
        draft_points(args, record, counter, prompts, baseline)
    print(record.table(), flush=True)


def save(records: list[dict], out_dir: Path) -> None:
    (out_dir / "spec_decode.json").write_text(json.dumps(records, indent=2) + "\n")
    md = out_dir / "spec_decode.md"
    md.unlink(missing_ok=True)
    append_table_rows(md, records, ["system", "k", "batch", "target", "compile"])


if __name__ == "__main__":
    main()
