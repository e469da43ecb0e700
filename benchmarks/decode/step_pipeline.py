"""What the engine's step pipeline saves: per-step host phases, with and without overlap.

    python -m benchmarks.decode step-pipeline [--num-requests 256] [--device-ms 10]

One engine (``random:tiny``, CPU, eager), ``--num-requests`` prompts decoded together. Each run
times, per step of the full batch, the engine's phases (schedule, submit, wait, update, process)
and the whole ``step()``; it runs twice per executor:

- ``cpu``: the real single-process executor on the CPU, where the forward runs on the host (in
  ``wait``), so overlap cannot save time there: this row checks that it costs none;
- ``device``: a stand-in device that takes ``--device-ms`` per step after ``submit`` (tokens are
  random ids, drawn at submit as the runner would), the shape of a GPU step: host work done
  between submit and wait is hidden behind it.

Prints a markdown table and writes it, as JSON and markdown, into ``--out`` (default ``$OUT``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from kiln import LLM, SamplingParams
from kiln.runtime.model_runner import RunnerOutput

from benchmarks.common import out_dir

PHASES = [("scheduler", "schedule"), ("executor", "submit"), ("executor", "wait"), ("scheduler", "update"),
          ("output_processor", "process")]


class StandInDevice:
    """``submit`` returns at once; ``wait`` returns ``device_ms`` after the submit."""

    def __init__(self, device_ms: float, vocab: int):
        self.device_ms, self.vocab = device_ms, vocab
        self.rng = random.Random(0)

    def submit(self, sched):
        ids = [s.request.request_id for s in sched.scheduled if s.samples]
        tokens = {rid: self.rng.randrange(1000, self.vocab) for rid in ids}
        return time.perf_counter() + self.device_ms / 1e3, tokens

    def wait(self, handle):
        done_at, tokens = handle
        while time.perf_counter() < done_at:
            pass  # spin: a sleep would add the OS's wake-up latency
        return RunnerOutput(tokens, {rid: None for rid in tokens})


def run(llm, args, overlap: bool, device_ms: float | None) -> dict:
    engine = llm.engine
    engine._overlap = overlap
    undo = []
    if device_ms is not None:
        stand_in = StandInDevice(device_ms, engine.executor.vocab_size)
        for name in ("submit", "wait"):
            setattr(engine.executor, name, getattr(stand_in, name))
            undo.append((engine.executor, name))
    current: dict[str, float] = {}
    for owner, name in PHASES:
        obj = getattr(engine, owner)

        def timed(*a, _fn=getattr(obj, name), _name=name):
            t0 = time.perf_counter()
            try:
                return _fn(*a)
            finally:
                current[_name] = current.get(_name, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)
        undo.append((obj, name))
    rng = random.Random(1)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i in range(args.num_requests):
        engine.add_request(f"r{i}", [rng.randrange(1000, 30000) for _ in range(args.prompt_len)], params)
    steps = []
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        current.clear()
        t0 = time.perf_counter()
        engine.step()
        steps.append({"step": time.perf_counter() - t0, **current})
    total_s = time.perf_counter() - t_start
    for obj, name in reversed(undo):
        vars(obj).pop(name, None)  # back to the class's method
    decode = steps[3:-3]  # full-batch decode steps: not the prefill, not the drain
    row = {f"{name}_ms": 1e3 * statistics.median(s.get(name, 0.0) for s in decode)
           for name in ["step"] + [n for _, n in PHASES]}
    row["output_tok_s"] = args.num_requests * args.output_len / total_s
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--device-ms", type=float, default=10.0)
    p.add_argument("--out", default=str(out_dir()))
    args = p.parse_args(argv)
    llm = LLM("random:tiny", compile={"mode": "eager"},
              scheduler={"max_num_seqs": args.num_requests,
                         "max_num_batched_tokens": max(2048, args.num_requests * args.prompt_len)})
    run(llm, argparse.Namespace(**{**vars(args), "output_len": 8}), False, None)  # warm-up
    rows = []
    for device_ms in (None, args.device_ms):
        for overlap in (False, True):
            rows.append({"executor": "cpu" if device_ms is None else f"device {device_ms:g} ms",
                         "overlap": overlap, **run(llm, args, overlap, device_ms)})
    table = markdown_table(rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"step_pipeline-tiny-{args.num_requests}req"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{stem}.md").write_text(table + "\n")


def markdown_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
