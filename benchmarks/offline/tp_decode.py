"""Does tensor parallelism pay off: batch-1 decode and offline throughput at TP = 1, 2, 4, 8.

For ``--model`` (random weights with real shapes, bf16) and each tensor-parallel size in ``--tp``
(1: ``parallel.backend=uni``; more: ``mp``, one worker process per GPU), each
``compile.mode`` x ``compile.cudagraph`` system in ``--systems`` and, for TP > 1, each
``parallel.all_reduce`` in ``--all-reduce`` (NCCL, or symmetric-memory one-shot for small inputs),
it measures:

- batch-1 decode: a ``--prompt-len`` prompt, ``--output-len`` new tokens, ``ignore_eos``; reported:
  output tok/s end to end, the decode step time ``(t(output_len) - t(1)) / (output_len - 1)`` and
  the executor's time per step (``b1_executor_ms``: from ``submit`` to the tokens back: the ranks'
  forward, sampling and the pipes, which overlap the engine's processing of the previous step's
  outputs; the engine's scheduling is outside it);
- offline throughput: ``--num-requests`` prompts of ``--offline-prompt-len`` tokens at once,
  ``--offline-output-len`` tokens each; output tok/s and total tok/s;
- start-up seconds (process spawn, weights, compile, graphs);
- scaling efficiency of TP = n against the smallest size measured, n0, of the same system:
  ``tok/s(n) / (n / n0 * tok/s(n0))`` (n0 = 1 unless the model needs more GPUs).

Greedy tokens of TP>1 are compared with TP=1 for the batch-1 prompt (``tokens_match_tp1``; bf16
all-reduce order may flip near-ties late in a long output, so a mismatch is reported, not fatal).
Correctness itself is ``tp_check.py``'s question: logits within bf16 rounding of TP=1, and equal
greedy tokens for an fp32 model without near-ties.
A system that fails is recorded with status ``error`` and the run goes on. Results (one JSON of all
records and a markdown table) go to ``--out``, rewritten after every system.

    python -m benchmarks.offline tp-decode --tp 1,2 --out "$OUT"                      # needs 2 GPUs
    python -m benchmarks.offline tp-decode --tp 1,2,4 --systems kiln:full --all-reduce nccl,symm_mem
    python -m benchmarks.offline tp-decode --model random:llama3-70b --tp 4,8 --systems kiln:full
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import append_table_rows, console_table, make_record, out_dir

MAX_MODEL_LEN = 2048


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    p.add_argument("--systems", default="eager:none,kiln:none,kiln:full",
                   help="compile.mode:compile.cudagraph pairs")
    p.add_argument("--all-reduce", default="nccl", help="parallel.all_reduce values tried at TP > 1")
    p.add_argument("--prompt-len", type=int, default=128, help="batch-1 prompt")
    p.add_argument("--output-len", type=int, default=128, help="batch-1 new tokens")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--offline-prompt-len", type=int, default=256)
    p.add_argument("--offline-output-len", type=int, default=256)
    p.add_argument("--step-timeout-s", type=float, default=180.0)
    p.add_argument("--out", default=str(out_dir()), help="directory for the JSON and markdown")
    return p.parse_args(argv)


def build(args, tp: int, mode: str, cudagraph: str, all_reduce: str):
    from kiln import LLM

    parallel = {"tensor_parallel_size": tp, "backend": "uni" if tp == 1 else "mp", "all_reduce": all_reduce,
                "step_timeout_s": args.step_timeout_s}
    return LLM({"model": args.model, "max_model_len": MAX_MODEL_LEN},
               compile={"mode": mode, "cudagraph": cudagraph}, parallel=parallel)


def timed_generate(llm, prompts, max_tokens: int) -> tuple[float, list]:
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()  # tokens come back to the host: generate returns after the GPU is done
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def measure(llm, args) -> tuple[dict, list[int]]:
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(args.prompt_len)]
    timed_generate(llm, [prompt], 8)  # warm-up: first-call costs are not decode
    t_one, _ = timed_generate(llm, [prompt], 1)
    executor = llm.engine.executor
    submit, wait, waits, started = executor.submit, executor.wait, [], []

    def timed_submit(sched):
        started.append(time.perf_counter())
        return submit(sched)

    def timed_wait(handle):  # from submit to the tokens (the engine processes outputs in between)
        out = wait(handle)
        waits.append(time.perf_counter() - started.pop())
        return out

    executor.submit, executor.wait = timed_submit, timed_wait  # the engine looks them up on every step
    try:
        t_all, tokens = timed_generate(llm, [prompt], args.output_len)
    finally:
        del executor.submit, executor.wait
    metrics = {"b1_output_tok_s": args.output_len / t_all,
               "b1_step_ms": 1e3 * (t_all - t_one) / (args.output_len - 1),
               "b1_executor_ms": 1e3 * sorted(waits[1:])[len(waits[1:]) // 2]}  # median decode step
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.offline_prompt_len)]
               for _ in range(args.num_requests)]
    t_batch, _ = timed_generate(llm, prompts, args.offline_output_len)
    num_out = args.num_requests * args.offline_output_len
    metrics.update(offline_output_tok_s=num_out / t_batch,
                   offline_total_tok_s=(num_out + args.num_requests * args.offline_prompt_len) / t_batch)
    return metrics, tokens[0]


def save(records: list[dict], out_dir: Path, model: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tag = model.split(":")[-1].replace(".", "")
    stem = f"tp_decode-{tag}-" + "".join(c if c.isalnum() else "_" for c in card).strip("_")
    (out_dir / f"{stem}.json").write_text(json.dumps(records, indent=1))
    md = out_dir / f"{stem}.md"
    if md.exists():
        md.unlink()
    append_table_rows(md, records, ["system", "tp", "all_reduce"])


def main(argv=None) -> None:
    args = parse_args(argv)
    sizes = [int(s) for s in args.tp.split(",")]
    systems = [tuple(s.split(":")) for s in args.systems.split(",")]
    if torch.cuda.is_available() and max(sizes) > torch.cuda.device_count():
        raise SystemExit(f"--tp {args.tp} needs {max(sizes)} GPUs; found {torch.cuda.device_count()}")
    reduces = args.all_reduce.split(",")
    records, reference, base = [], {}, {}
    runs = [(mode, cudagraph, tp, ar) for mode, cudagraph in systems for tp in sizes
            for ar in (["nccl"] if tp == 1 else reduces)]
    for mode, cudagraph, tp, all_reduce in runs:
        config = {"system": f"kiln-{mode}-{cudagraph}", "tp": tp, "all_reduce": all_reduce if tp > 1 else "-",
                  "prompt_len": args.prompt_len, "output_len": args.output_len,
                  "num_requests": args.num_requests, "offline_prompt_len": args.offline_prompt_len,
                  "offline_output_len": args.offline_output_len}
        llm = None
        try:
            t0 = time.perf_counter()
            llm = build(args, tp, mode, cudagraph, all_reduce)
            startup_s = time.perf_counter() - t0
            metrics, tokens = measure(llm, args)
            metrics["startup_s"] = startup_s
            if tp == 1:
                reference[mode, cudagraph] = tokens
            elif (mode, cudagraph) in reference:
                metrics["tokens_match_tp1"] = float(tokens == reference[mode, cudagraph])
            if (mode, cudagraph) not in base:  # the smallest size measured is the scaling baseline
                base[mode, cudagraph] = (tp, metrics)
            elif tp > base[mode, cudagraph][0]:
                tp0, m0 = base[mode, cudagraph]
                for key in ("b1_output_tok_s", "offline_output_tok_s"):
                    metrics[key.replace("output_tok_s", "scaling_eff")] = metrics[key] / (tp / tp0 * m0[key])
                metrics["scaling_base_tp"] = tp0
            records.append(make_record("tp_decode", args.model, config, metrics))
        except Exception as exc:  # noqa: BLE001  (record it, go on with the next system)
            traceback.print_exc()
            records.append(make_record("tp_decode", args.model, config, status="error", error=repr(exc)))
        finally:
            if llm is not None:
                llm.engine.shutdown()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        save(records, Path(args.out), args.model)
    keys = ["b1_output_tok_s", "b1_step_ms", "b1_executor_ms", "offline_output_tok_s", "b1_scaling_eff",
            "offline_scaling_eff", "startup_s", "tokens_match_tp1"]
    print(console_table(["system", "tp", "all_reduce", *keys], [[r["config"]["system"], r["config"]["tp"],
                                                                 r["config"]["all_reduce"],
                                                   *(r["metrics"].get(k, r.get("error") or "-") for k in keys)]
                                                  for r in records]), flush=True)


if __name__ == "__main__":
    main()
