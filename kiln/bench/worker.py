"""One benchmark run in its own process: ``python -m kiln.bench.worker SPEC RESULT``.

SPEC is the JSON that ``sweep.run_job`` wrote ({name, model, config}); RESULT receives one record
(``kiln.bench.report`` format). Whatever the run raises is caught and recorded as status "error" with a
one-line reason (the traceback goes to ``error.txt`` beside RESULT), so a sweep always gets a record.

Start-up (``startup_s``: ``LLM`` construction, loading and compiling included) is measured apart
from generation; the first, untimed-for-throughput generate (``warmup_s``) absorbs lazy compilation.
Throughput and latency runs measure the steady state: where kiln's forward is built in the background
(``compile.startup=auto`` on the CPU, or ``fast``), they wait for it first (``build_wait_s``, after start-up).
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from pathlib import Path

from kiln.bench.report import make_record, write_record
from kiln.bench.sweep import BenchConfig
from kiln.config import EngineConfig


def build_llm(engine: EngineConfig):
    """The LLM and the seconds its construction took."""
    from kiln.entrypoints.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=engine.model, cache=engine.cache, scheduler=engine.scheduler,
              compile=engine.compile, parallel=engine.parallel, speculative=engine.speculative, kernels=engine.kernels)
    return llm, time.perf_counter() - t0


def wait_for_build(llm) -> dict:
    """Wait for a background build (compile.startup=auto on a cold start, or fast) to end: its seconds after start-up."""
    t0 = time.perf_counter()
    llm.engine.wait_for_build()
    return {"build_wait_s": time.perf_counter() - t0}


def spec_metrics(llm) -> dict:
    """Speculative decoding's counts over the run (none while it is off): proposed and kept tokens,
    the acceptance rate and, per proposal position, how often it was kept."""
    stats = llm.engine.spec_stats
    if not stats.num_drafts:
        return {}
    out = {"spec_draft_tokens": stats.num_draft_tokens, "spec_accepted_tokens": stats.num_accepted_tokens,
           "spec_acceptance_rate": stats.acceptance_rate,
           "spec_mean_accepted_per_step": stats.num_accepted_tokens / stats.num_drafts}
    out.update({f"spec_accepted_pos{i}": n for i, n in enumerate(stats.accepted_per_position)})
    return out


def make_prompts(llm, num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Random token ids of exactly ``prompt_len`` tokens, away from the low (special) ids."""
    import torch

    vocab = getattr(llm.engine.executor, "vocab_size", None) or len(llm.tokenizer)
    low = min(100, vocab // 4)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (num_prompts, prompt_len), generator=gen).tolist()


def fixed_length(max_tokens: int):
    from kiln.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def percentiles(name: str, values_ms: list[float]) -> dict[str, float]:
    import numpy as np

    if not values_ms:
        return {}
    return {f"{name}_ms_p{p}": float(np.percentile(values_ms, p)) for p in (50, 90, 99)}


def warm_up(llm, bench: BenchConfig) -> tuple[list[list[int]], float]:
    """The throughput prompts, and the seconds of one short generate over all of them (lazy
    compilation happens there, and their prefixes land in the cache as the timed rounds will find them)."""
    prompts = make_prompts(llm, max(bench.batch_sizes), bench.prompt_len, bench.seed)
    t0 = time.perf_counter()
    llm.generate(prompts, fixed_length(min(4, bench.output_len)), use_tqdm=False)
    return prompts, time.perf_counter() - t0


def throughput_at(llm, prompts: list[list[int]], bs: int, bench: BenchConfig) -> tuple[float, float]:
    """Output tokens and requests per second of rounds of ``bs`` concurrent requests, until at least
    ``bench.num_requests`` have finished."""
    rounds = max(1, math.ceil(bench.num_requests / bs))
    num_tokens = 0
    t0 = time.perf_counter()
    for _ in range(rounds):
        outs = llm.generate(prompts[:bs], fixed_length(bench.output_len), use_tqdm=False)
        num_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - t0
    return num_tokens / elapsed, rounds * bs / elapsed


def measure_throughput(engine: EngineConfig, bench: BenchConfig) -> dict:
    from tqdm.auto import tqdm

    llm, startup_s = build_llm(engine)
    built = wait_for_build(llm)
    prompts, warmup_s = warm_up(llm, bench)
    metrics = {"startup_s": startup_s, **built, "warmup_s": warmup_s}
    for bs in tqdm(bench.batch_sizes, desc="batch sizes", dynamic_ncols=True):
        metrics[f"output_tok_s_bs{bs}"], metrics[f"requests_s_bs{bs}"] = throughput_at(llm, prompts, bs, bench)
    return {**metrics, **spec_metrics(llm)}


def measure_latency(engine: EngineConfig, bench: BenchConfig) -> dict:
    """One request at a time through the engine's step loop: TTFT and time per output token."""
    from tqdm.auto import tqdm

    llm, startup_s = build_llm(engine)
    built = wait_for_build(llm)
    prompts = make_prompts(llm, bench.num_iters + 1, bench.prompt_len, bench.seed)
    params = fixed_length(bench.output_len)
    t0 = time.perf_counter()
    _timed_request(llm.engine, "warmup", prompts[-1], params)
    metrics = {"startup_s": startup_s, **built, "warmup_s": time.perf_counter() - t0}
    ttft, tpot, e2e = [], [], []
    for i in tqdm(range(bench.num_iters), desc="requests", dynamic_ncols=True):
        arrivals = _timed_request(llm.engine, f"latency-{i}", prompts[i], params)
        ttft.append(arrivals[0] * 1e3)
        tpot.extend((b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:]))
        e2e.append(arrivals[-1] * 1e3)
    return {**metrics, **percentiles("ttft", ttft), **percentiles("tpot", tpot), **percentiles("e2e", e2e),
            **spec_metrics(llm)}


def _timed_request(engine, request_id: str, prompt: list[int], params) -> list[float]:
    """Seconds from submission to each output token of one request (tokens of one step share a time)."""
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    arrivals: list[float] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            if out.request_id == request_id:
                arrivals += [now] * (len(out.outputs[0].token_ids) - len(arrivals))
    if not arrivals:
        raise RuntimeError(f"request {request_id} finished without output tokens")
    return arrivals


def measure_startup(engine: EngineConfig, bench: BenchConfig) -> dict:
    llm, startup_s = build_llm(engine)
    prompts = make_prompts(llm, 1, bench.prompt_len, bench.seed)
    t0 = time.perf_counter()
    llm.generate(prompts, fixed_length(8), use_tqdm=False)
    return {"startup_s": startup_s, "first_generate_s": time.perf_counter() - t0}


def measure_serve(engine: EngineConfig, bench: BenchConfig) -> dict:
    from kiln.bench.serve import measure_serve as serve

    return serve(engine, bench)


MEASURES = {
    "throughput": measure_throughput,
    "latency": measure_latency,
    "startup": measure_startup,
    "serve": measure_serve,
}


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def main(argv: list[str]) -> int:
    import json

    if len(argv) != 2:
        print("usage: python -m kiln.bench.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    config = dict(spec["config"])
    bench = BenchConfig(**config.pop("bench"))
    try:
        engine = EngineConfig.from_kwargs(**config)
        record = make_record(spec["name"], spec["model"], spec["config"], MEASURES[bench.kind](engine, bench))
    except Exception as exc:  # every failure becomes a record: the sweep goes on
        (result_path.parent / "error.txt").write_text(traceback.format_exc())
        record = make_record(spec["name"], spec["model"], spec["config"], status="error", error=one_line(exc))
    write_record(record, result_path)
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
