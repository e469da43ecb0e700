"""Which compile mode serves fastest on this machine? eager vs stock vs kiln, one run.

For each ``compile.mode``: start-up time (engine build plus the first generate, where
torch.compile does its work), batch-1 decode tok/s, and output tok/s of N concurrent requests
(prompt P, output O, ignore_eos). For kiln it also times the compiled forward's call paths at one
token: through Dynamo's guards, kiln's direct call, and the pieces alone.

    python -m benchmarks.offline compile-modes                       # SmolLM2, 32 x (128 in, 64 out)
    python -m benchmarks.offline compile-modes --num-requests 8 --output-len 16   # quicker

``--rounds R`` instead builds every mode's engine in this one process, then runs ``kiln bench``'s
throughput measurement (``bench.batch_sizes`` rounds of concurrent requests, the bench's prompts)
for each mode in turn, R times over, and reports each mode's median output tok/s per batch size.
A sweep runs each mode in its own process minutes apart, so on a shared machine its rows also
measure how busy the machine was at the time; taking turns spreads that over every mode alike.

    python -m benchmarks.offline compile-modes --rounds 3            # SmolLM2, batch 1 / 8 / 32

Writes ``compile_modes_<device>_<model>.{json,md}`` into ``$OUT`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from benchmarks.common import mean_us, out_dir, timed_generate
from kiln import LLM
from kiln.compiler import KilnForward
from kiln.forward_context import AttentionMetadata, ForwardContext, forward_context



def _prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the low ids (special tokens) so no prompt holds an EOS or chat marker.
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(num)]


def _decode_step_timings(runner, num_requests: int, iters: int) -> dict[str, float]:
    """Per-call µs of the forward's call paths on a decode step of ``num_requests`` tokens."""
    with torch.inference_mode():  # as in ModelRunner.execute: Dynamo's guards check this too
        return _decode_step_timings_inner(runner, num_requests, iters)


def _decode_step_timings_inner(runner, num_requests: int, iters: int) -> dict[str, float]:
    context_len, block_size = 16, runner.block_size
    seq_lens = [context_len] * num_requests
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([i * block_size + context_len - 1 for i in range(num_requests)]),
        query_start_loc=torch.arange(num_requests + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(num_requests, dtype=torch.int32)[:, None] * -(-context_len // block_size),
        num_decodes=num_requests, max_query_len=1, max_seq_len=context_len,
        query_lens_cpu=[1] * num_requests, seq_lens_cpu=seq_lens,
    )
    ids, pos = torch.full((num_requests,), 1234), torch.full((num_requests,), context_len - 1)
    with forward_context(ForwardContext(attn=meta, kv_caches=runner.kv_caches)) as ctx:
        times = runner.compiled.forward.time_call_paths(ids, pos, iters)
        # The eager model with the attention kernel the engine gives it (the context's impl; left
        # unset, the op would run the pure-torch reference and the eager row would be too slow).
        ctx.attention_impl = runner.compiled.kernels.attention.impl
        times["eager_model"] = mean_us(lambda: runner.model(ids, pos), iters)
    return times


def bench_mode(mode: str, args) -> dict:
    t0 = time.perf_counter()
    llm = LLM(args.model, compile={"mode": mode, "sizes": tuple(args.sizes)})
    build_s = time.perf_counter() - t0
    runner = llm.engine.executor.runner
    vocab = runner.arch.vocab_size
    # First generate: prefill and decode shapes meet torch.compile here (stock also recompiles
    # for one token; kiln captures once).
    first_s = timed_generate(llm, _prompts(vocab, 2, args.prompt_len, seed=1), 4)
    one = _prompts(vocab, 1, args.prompt_len, seed=2)
    prefill_s = min(timed_generate(llm, one, 1) for _ in range(2))
    full_s = min(timed_generate(llm, one, args.output_len + 1) for _ in range(2))
    batch_s = timed_generate(llm, _prompts(vocab, args.num_requests, args.prompt_len, seed=3), args.output_len)
    row = {
        "mode": mode,
        "startup_s": round(build_s + first_s, 2),
        "decode_bs1_tok_s": round(args.output_len / (full_s - prefill_s), 2),
        f"concurrent{args.num_requests}_out_tok_s": round(args.num_requests * args.output_len / batch_s, 2),
    }
    forward = runner.compiled.forward
    if isinstance(forward, KilnForward):
        row["kiln_compile_s"] = round(forward.compile_seconds, 2)
        row["kiln_inductor_builds"] = forward.num_compiles
        row["kiln_recompiles"] = forward.num_recompiles
        for n in (1, 2):
            timings = _decode_step_timings(runner, n, args.overhead_iters)
            row[f"call_us_bs{n}"] = {k: round(v, 1) for k, v in timings.items()}
    if mode == "stock":
        row["dynamo_unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return row


def interleaved(args) -> list[dict]:
    """``--rounds``: every mode's engine built first, then the bench's throughput rounds taking turns."""
    import statistics

    from kiln.bench.sweep import BenchConfig
    from kiln.bench.worker import throughput_at, warm_up

    bench = BenchConfig(batch_sizes=tuple(args.batch_sizes), prompt_len=args.prompt_len, output_len=args.output_len,
                        num_requests=args.bench_requests)
    engines = {}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        llm = LLM(args.model, compile={"mode": mode})
        llm.engine.wait_for_build()
        engines[mode] = (llm, warm_up(llm, bench)[0])
        print(f"{mode}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    samples = {mode: {bs: [] for bs in bench.batch_sizes} for mode in engines}
    for r in range(args.rounds):
        for mode, (llm, prompts) in engines.items():
            for bs in bench.batch_sizes:
                samples[mode][bs].append(throughput_at(llm, prompts, bs, bench)[0])
            last = " ".join(f"bs{bs} {samples[mode][bs][-1]:.1f}" for bs in bench.batch_sizes)
            print(f"round {r + 1}: {mode} {last}", flush=True)
    return [{"mode": mode, **{f"output_tok_s_bs{bs}": round(statistics.median(v), 2) for bs, v in per_bs.items()},
             **{f"rounds_bs{bs}": [round(x, 1) for x in v] for bs, v in per_bs.items()}}
            for mode, per_bs in samples.items()]


def _markdown(rows: list[dict], meta: dict) -> str:
    keys = [k for k in rows[0] if not k.startswith("call_us")]
    for r in rows:
        keys += [k for k in r if k not in keys and not k.startswith("call_us")]
    lines = [f"# compile modes on {meta['device']} ({meta['model']})", "",
             f"prompt {meta['prompt_len']}, output {meta['output_len']}, "
             + (f"{meta['rounds']} rounds taking turns in one process over batch sizes {meta['batch_sizes']} "
                f"(at least {meta['bench_requests']} requests each; medians, then each round); "
                if meta.get("rounds") else f"{meta['num_requests']} concurrent; ")
             + f"torch {meta['torch']}, {meta['threads']} threads, load average {meta['load_avg_at_start']:.1f} "
             f"at start on {os.cpu_count()} cores", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    for r in rows:
        for key in (k for k in r if k.startswith("call_us")):
            lines += ["", f"Per-call µs of the forward, {key.removeprefix('call_us_bs')}-token decode ({r['mode']}):", "",
                      "| path | µs |", "|---|---|"] + [f"| {k} | {v} |" for k, v in r[key].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--modes", default="eager,stock,kiln")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--sizes", type=int, nargs="*", default=[], help="compile.sizes (static builds)")
    p.add_argument("--overhead-iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); on a shared "
                   "machine 1 avoids OpenMP threads spinning against other jobs")
    p.add_argument("--rounds", type=int, default=0,
                   help="build every mode in this process, then R rounds of the bench's throughput runs taking turns")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="--rounds: concurrent requests")
    p.add_argument("--bench-requests", type=int, default=8,
                   help="--rounds: at least this many requests per batch size (kiln bench's num_requests)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    meta = {"model": args.model, "device": device, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "num_requests": args.num_requests, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "sizes": args.sizes, "load_avg_at_start": os.getloadavg()[0]}
    rows = []
    if args.rounds:
        meta.update(rounds=args.rounds, batch_sizes=args.batch_sizes, bench_requests=args.bench_requests)
        rows = interleaved(args)
    else:
        for mode in args.modes.split(","):
            rows.append(bench_mode(mode, args))
            print(json.dumps(rows[-1]), flush=True)
    suffix = "_interleaved" if args.rounds else ""
    stem = os.path.join(out_dir(), f"compile_modes_{device}_{args.model.replace(':', '-').replace('/', '_')}{suffix}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    md = _markdown(rows, meta)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
