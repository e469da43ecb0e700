"""Is tensor parallelism correct: TP = n against TP = 1, on the logits and on greedy tokens.

Two checks, one record per (check, system, TP > 1), each against TP = 1 of the same system
(``compile.mode:compile.cudagraph`` in ``--systems``):

- ``logits``: one prefill of a fixed ``--prompt-len`` prompt of ``--logits-model`` (random weights
  with real shapes; bf16 by default). The first step's logits of the prompt's last token, captured
  where rank 0 hands them to the sampler (so after the vocab-parallel all-gather), at TP = n vs
  TP = 1: ``max_abs_diff``, ``rel_l2`` = ||l_n - l_1|| / ||l_1||, ``argmax_match``. Below fp32 the
  record also holds ``rel_l2_tp1_vs_fp32``, TP = 1 against TP = 1 in fp32: what the dtype's rounding
  alone costs, the scale a TP difference from a different summation order should stay within; a
  wrong shard gives rel_l2 of order 1. ``passed`` when the argmax matches and ``rel_l2`` is at most
  the larger of ``--max-rel-l2`` and that rounding floor (on an H100, random llama3-8b in bf16:
  TP = 2 0.057 and TP = 4 0.064 against a floor of 0.075).
- ``greedy``: ``--greedy-steps`` greedy tokens of ``--greedy-model`` in ``--greedy-dtype`` (fp32 by
  default, so no two logits are near enough to tie) through the ``LLM`` API (``parallel.backend=mp``
  at TP > 1): ``tokens_match_tp1``, ``num_matching_tokens`` (before the first difference),
  ``max_logprob_diff`` over the top ``LOGPROBS`` logprobs of the matching steps, and
  ``min_top2_margin_tp1`` (the smallest gap between TP = 1's best two logprobs: a mismatch where it
  is tiny is a tie, not a bug); ``passed`` when the tokens match.

Each TP size of the logits check runs in fresh processes (one per rank, NCCL on CUDA, gloo on the
CPU). Results (one JSON of all records and a markdown table) go to ``--out``; the exit status is 1
when a check did not pass or failed to run.

    python -m benchmarks.offline tp-check --tp 1,2,4 --out "$OUT"                        # needs 4 GPUs
    python -m benchmarks.offline tp-check --device cpu --tp 1,2 --systems eager:none --logits-model random:tiny \
        --logits-dtype bfloat16 --out /tmp/tp_check                               # the CPU path (gloo)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import append_table_rows, console_table, make_record, out_dir

MAX_MODEL_LEN = 2048
LOGPROBS = 5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes; 1 is the reference and always runs")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--systems", default="eager:none,kiln:full", help="compile.mode:compile.cudagraph pairs")
    p.add_argument("--checks", default="logits,greedy")
    p.add_argument("--logits-model", default="random:llama3-8b")
    p.add_argument("--logits-dtype", default="bfloat16")
    p.add_argument("--max-rel-l2", type=float, default=0.05, help="logits: the largest relative L2 that passes, "
                   "raised to the dtype's own rounding error (TP=1 vs fp32) where that is larger")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--greedy-model", default="random:tiny")
    p.add_argument("--greedy-dtype", default="float32")
    p.add_argument("--greedy-steps", type=int, default=32)
    p.add_argument("--out", default=str(out_dir()), help="directory for the JSON and markdown")
    return p.parse_args(argv)


def fixed_prompt(length: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(1000, 30000) for _ in range(length)]


# ---- logits: one prefill per TP size, in fresh rank processes ---------------------------------------
@dataclass(frozen=True)
class PrefillSpec:
    model: str
    dtype: str
    device: str
    mode: str
    cudagraph: str
    prompt: list[int]


def prefill_logits(spec: PrefillSpec, tp: int) -> torch.Tensor:
    """The first step's logits ([vocab] float32) of ``spec.prompt``'s last token at TP = ``tp``."""
    import torch.multiprocessing as mp

    from kiln.runtime.worker import free_port

    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_prefill_rank, args=(spec, rank, tp, init_method, answers)) for rank in range(tp)]
    for proc in procs:
        proc.start()
    try:
        kind, value = _first_answer(answers, procs)  # rank 0's logits, or the first rank error
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    if kind == "error":
        raise RuntimeError(f"a rank of TP={tp} failed: {value}")
    return torch.from_numpy(value)


def _first_answer(answers, procs) -> tuple:
    import queue

    while True:
        try:
            return answers.get(timeout=5.0)
        except queue.Empty:
            # Rank 0 answers before it exits, and the others exit 0 only after their part is done.
            dead = [rank for rank, proc in enumerate(procs)
                    if proc.exitcode not in (None, 0) or (rank == 0 and proc.exitcode is not None)]
            if dead:  # a rank that died without a word (a crash): its peers would wait for it
                return "error", f"rank(s) {dead} exited ({[procs[r].exitcode for r in dead]}) without an answer"


def _prefill_rank(spec: PrefillSpec, rank: int, size: int, init_method: str, answers) -> None:
    """One rank: its runner shard schedules and runs the prompt's prefill as the engine would (every
    rank schedules the same step from the same request); rank 0 answers with the sampler's logits."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from kiln.config import CacheConfig, CompileConfig, ModelConfig, SchedulerConfig
    from kiln.models.parallel import TensorParallel
    from kiln.runtime.kv_cache_manager import KVCacheManager
    from kiln.runtime.model_runner import ModelRunner
    from kiln.runtime.request import Request
    from kiln.runtime.scheduler import Scheduler
    from kiln.sampling_params import SamplingParams

    try:
        if spec.device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        if size > 1:
            dist.init_process_group("nccl" if spec.device == "cuda" else "gloo", init_method=init_method,
                                    rank=rank, world_size=size, timeout=timedelta(seconds=600))
        cache, scheduler_config = CacheConfig(kv_cache_memory_gib=1.0), SchedulerConfig()  # one prompt: ample
        model = ModelConfig(model=spec.model, dtype=spec.dtype, device=spec.device, max_model_len=MAX_MODEL_LEN)
        compile = CompileConfig(mode=spec.mode, cudagraph=spec.cudagraph)
        runner = ModelRunner(model, cache, compile, scheduler_config, TensorParallel(rank, size))
        scheduler = Scheduler(scheduler_config, KVCacheManager(runner.num_blocks, cache.block_size,
                                                               cache.enable_prefix_caching))
        scheduler.add_request(Request(request_id="check", prompt_token_ids=list(spec.prompt),
                                      sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                                      max_model_len=runner.max_model_len))
        captured = []
        launch = runner.sampler.launch

        def capture(logits, *args, **kwargs):  # rank 0 alone samples: the gathered [1, vocab] logits
            captured.append(logits.float().cpu())
            return launch(logits, *args, **kwargs)

        runner.sampler.launch = capture
        runner.execute(scheduler.schedule())
        if rank == 0:
            (logits,) = captured
            answers.put(("ok", logits[0].numpy()))
    except BaseException as exc:  # noqa: BLE001  (the parent raises it)
        traceback.print_exc()
        answers.put(("error", f"rank {rank}: {exc!r}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def compare_logits(got: torch.Tensor, want: torch.Tensor, max_rel_l2: float) -> dict:
    """``max_rel_l2``: the bound, already raised to the dtype's rounding floor where there is one."""
    rel_l2 = relative_l2(got, want)
    argmax_match = bool(got.argmax() == want.argmax())
    return {"max_abs_diff": float((got - want).abs().max()), "rel_l2": rel_l2,
            "logits_abs_max_tp1": float(want.abs().max()), "argmax_match": float(argmax_match),
            "passed": float(argmax_match and rel_l2 <= max_rel_l2)}


def logits_check(args, mode: str, cudagraph: str) -> Callable[[int], dict]:
    """Runs TP = 1 (and, below fp32, TP = 1 in fp32); returns the measurement of a TP size."""
    spec = PrefillSpec(args.logits_model, args.logits_dtype, args.device, mode, cudagraph,
                       fixed_prompt(args.prompt_len))
    reference = prefill_logits(spec, 1)
    floor = {}
    if spec.dtype != "float32":  # what the dtype alone costs: the scale to read a TP difference against
        fp32 = prefill_logits(dataclasses.replace(spec, dtype="float32"), 1)
        floor["rel_l2_tp1_vs_fp32"] = relative_l2(reference, fp32)
    bound = max(args.max_rel_l2, floor.get("rel_l2_tp1_vs_fp32", 0.0))
    return lambda tp: {**compare_logits(prefill_logits(spec, tp), reference, bound), **floor}


# ---- greedy: the engine, TP = n against TP = 1 -----------------------------------------------------
def greedy_completion(args, tp: int, mode: str, cudagraph: str):
    from kiln import LLM, SamplingParams

    parallel = {"tensor_parallel_size": tp, "backend": "uni" if tp == 1 else "mp"}
    llm = LLM({"model": args.greedy_model, "dtype": args.greedy_dtype, "device": args.device,
               "max_model_len": MAX_MODEL_LEN}, compile={"mode": mode, "cudagraph": cudagraph},
              cache={"kv_cache_memory_gib": 1.0}, parallel=parallel)  # a small model needs no more
    try:
        params = SamplingParams(max_tokens=args.greedy_steps, temperature=0.0, ignore_eos=True, logprobs=LOGPROBS)
        return llm.generate([fixed_prompt(args.prompt_len)], params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()  # TP = 1 runs in this process: free its GPU memory for the ranks that follow
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def compare_greedy(got, want) -> dict:
    num_matching = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
                        min(len(got.token_ids), len(want.token_ids)))
    diffs = [abs(got.logprobs[i][t] - want.logprobs[i][t]) for i in range(num_matching)
             for t in want.logprobs[i].keys() & got.logprobs[i].keys()]
    margins = [a - b for a, b in (sorted(lp.values(), reverse=True)[:2] for lp in want.logprobs)]
    match = float(got.token_ids == want.token_ids)
    return {"tokens_match_tp1": match, "num_matching_tokens": num_matching, "num_tokens": len(want.token_ids),
            "max_logprob_diff": max(diffs, default=0.0), "min_top2_margin_tp1": min(margins), "passed": match}


def greedy_check(args, mode: str, cudagraph: str) -> Callable[[int], dict]:
    """Runs TP = 1; returns the measurement of a TP size."""
    reference = greedy_completion(args, 1, mode, cudagraph)
    return lambda tp: compare_greedy(greedy_completion(args, tp, mode, cudagraph), reference)


# ---- driver ----------------------------------------------------------------------------------------
CHECKS = {"logits": logits_check, "greedy": greedy_check}


def run_check(args, check: str, mode: str, cudagraph: str, sizes: list[int]) -> list[dict]:
    """TP = 1, then one record per larger size (an error record for whatever fails to run)."""
    model, dtype = ((args.logits_model, args.logits_dtype) if check == "logits"
                    else (args.greedy_model, args.greedy_dtype))
    config = {"check": check, "system": f"kiln-{mode}-{cudagraph}", "dtype": dtype, "device": args.device,
              "prompt_len": args.prompt_len, **({"steps": args.greedy_steps} if check == "greedy" else {})}
    try:
        measure = CHECKS[check](args, mode, cudagraph)
    except Exception as exc:  # noqa: BLE001  (record it, go on with the next check)
        traceback.print_exc()
        return [make_record("tp_check", model, {**config, "tp": tp}, status="error", error=f"TP=1: {exc!r}")
                for tp in sizes if tp > 1]
    records = []
    for tp in (s for s in sizes if s > 1):
        try:
            records.append(make_record("tp_check", model, {**config, "tp": tp}, measure(tp)))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            records.append(make_record("tp_check", model, {**config, "tp": tp}, status="error", error=repr(exc)))
    return records


def save(records: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    stem = "tp_check-" + "".join(c if c.isalnum() else "_" for c in card).strip("_")
    (out_dir / f"{stem}.json").write_text(json.dumps(records, indent=1))
    md = out_dir / f"{stem}.md"
    if md.exists():
        md.unlink()
    append_table_rows(md, records, ["check", "system", "tp", "dtype"])


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = sorted({int(s) for s in args.tp.split(",")})
    if args.device == "cuda" and max(sizes) > torch.cuda.device_count():
        raise SystemExit(f"--tp {args.tp} needs {max(sizes)} GPUs; found {torch.cuda.device_count()}")
    records = []
    for mode, cudagraph in (s.split(":") for s in args.systems.split(",")):  # a system at a time: a run
        for check in args.checks.split(","):  # stopped at its time limit keeps what it finished
            records += run_check(args, check, mode, cudagraph, sizes)
            save(records, Path(args.out))
    keys = ["passed", "max_abs_diff", "rel_l2", "rel_l2_tp1_vs_fp32", "argmax_match", "tokens_match_tp1",
            "num_matching_tokens", "max_logprob_diff", "min_top2_margin_tp1"]
    rows = [[r["config"]["check"], r["config"]["system"], r["config"]["tp"],
             *(r["metrics"].get(k, "error" if r["status"] != "ok" and k == "passed" else "-") for k in keys)]
            for r in records]
    print(console_table(["check", "system", "tp", *keys], rows), flush=True)
    for r in records:
        if r["status"] != "ok":
            print(f"{r['config']['check']} {r['config']['system']} tp={r['config']['tp']}: {r['error']}", flush=True)
    return 0 if records and all(r["status"] == "ok" and r["metrics"]["passed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
