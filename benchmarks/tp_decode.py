"""Does tensor parallelism over two GPUs pay off for Llama-3-8B: batch-1 decode and offline throughput?

For ``--model`` (random weights with real shapes, bf16) and each tensor-parallel size in ``--tp``
(1: ``parallel.backend=uni``; more: ``mp``, one worker process per GPU, NCCL all-reduces), and each
``compile.mode`` x ``compile.cudagraph`` system in ``--systems``, it measures:

- batch-1 decode: a ``--prompt-len`` prompt, ``--output-len`` new tokens, ``ignore_eos``; reported:
  output tok/s end to end and the decode step time ``(t(output_len) - t(1)) / (output_len - 1)``;
- offline throughput: ``--num-requests`` prompts of ``--prompt-len`` tokens at once, ``--output-len``
  tokens each; output tok/s and total tok/s;
- start-up seconds (process spawn, weights, compile, graphs).

Greedy tokens of TP>1 are compared with TP=1 for the batch-1 prompt (``tokens_match_tp1``; bf16
all-reduce order may flip near-ties late in a long output, so a mismatch is reported, not fatal).
A system that fails is recorded with status ``error`` and the run goes on. Results (one JSON of all
records and a markdown table) go to ``--out``, rewritten after every system.

    python benchmarks/tp_decode.py --out "$OUT"             # needs 2 GPUs
    python benchmarks/tp_decode.py --tp 1,2 --systems eager:none,kiln:full --num-requests 64
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

from common import append_table_rows, console_table, make_record

MAX_MODEL_LEN = 2048


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    p.add_argument("--systems", default="eager:none,kiln:none,kiln:full",
                   help="compile.mode:compile.cudagraph pairs")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and markdown")
    return p.parse_args(argv)


def build(args, tp: int, mode: str, cudagraph: str):
    from kiln import LLM

    parallel = {"tensor_parallel_size": tp, "backend": "uni" if tp == 1 else "mp"}
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
    t_all, tokens = timed_generate(llm, [prompt], args.output_len)
    metrics = {"b1_output_tok_s": args.output_len / t_all,
               "b1_step_ms": 1e3 * (t_all - t_one) / (args.output_len - 1)}
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    t_batch, _ = timed_generate(llm, prompts, args.output_len)
    num_out = args.num_requests * args.output_len
    metrics.update(offline_output_tok_s=num_out / t_batch,
                   offline_total_tok_s=(num_out + args.num_requests * args.prompt_len) / t_batch)
    return metrics, tokens[0]


def save(records: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    stem = "tp_decode-" + "".join(c if c.isalnum() else "_" for c in card).strip("_")
    (out_dir / f"{stem}.json").write_text(json.dumps(records, indent=1))
    md = out_dir / f"{stem}.md"
    if md.exists():
        md.unlink()
    append_table_rows(md, records, ["system", "tp"])


def main(argv=None) -> None:
    args = parse_args(argv)
    sizes = [int(s) for s in args.tp.split(",")]
    systems = [tuple(s.split(":")) for s in args.systems.split(",")]
    if max(sizes) > max(torch.cuda.device_count(), 1):
        raise SystemExit(f"--tp {args.tp} needs {max(sizes)} GPUs; found {torch.cuda.device_count()}")
    records, reference = [], {}
    for mode, cudagraph in systems:
        for tp in sizes:
            config = {"system": f"kiln-{mode}-{cudagraph}", "tp": tp, "prompt_len": args.prompt_len,
                      "output_len": args.output_len, "num_requests": args.num_requests}
            llm = None
            try:
                t0 = time.perf_counter()
                llm = build(args, tp, mode, cudagraph)
                startup_s = time.perf_counter() - t0
                metrics, tokens = measure(llm, args)
                metrics["startup_s"] = startup_s
                if tp == 1:
                    reference[mode, cudagraph] = tokens
                elif (mode, cudagraph) in reference:
                    metrics["tokens_match_tp1"] = float(tokens == reference[mode, cudagraph])
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
            save(records, Path(args.out))
    keys = ["b1_output_tok_s", "b1_step_ms", "offline_output_tok_s", "startup_s", "tokens_match_tp1"]
    print(console_table(["system", "tp", *keys], [[r["config"]["system"], r["config"]["tp"],
                                                   *(r["metrics"].get(k, r.get("error") or "-") for k in keys)]
                                                  for r in records]), flush=True)


if __name__ == "__main__":
    main()
