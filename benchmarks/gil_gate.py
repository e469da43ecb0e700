"""Eager steps beside a background build's Python, on the CPU: what the GIL costs a step, and what
a gate that parks the build's Python while a step runs would give back.

A background build (``compile.build=background``) first imports Dynamo and Inductor: seconds of
Python holding the GIL. An eager step releases the GIL at every torch op and must get it back each
time, so a step beside the build waits. This measures that with a stand-in: a step is ``--ops``
small torch ops on a 16-float CPU tensor (one thread), run back to back with ``--gap-ms`` of idle
between steps, while a thread imports ``torch._dynamo`` and ``torch._inductor`` (each variant in a
fresh process, so the imports are cold for every one). Variants:

    none-5ms     no gate, Python's default switch interval (5 ms)
    none-0.1ms   no gate, 0.1 ms (what kiln sets while a CUDA build runs)
    gate-0.1ms   the build's thread runs under ``sys.setprofile``: at each Python call, while a step
                 runs, it waits (GIL released) until the step ends, at most 50 ms a wait
    idle         the imports alone, no steps (the build's time without steps)
    idle-hook    the same under the profile hook (what a Python-level hook costs the build)

It stands in for a CUDA step (kernel launches, not CPU ops) and for the first phase of a warm
build only; the numbers are for deciding what to measure on a GPU, not a result about one.

    PYTHONPATH=$PWD python benchmarks/gil_gate.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

VARIANTS = ("none-5ms", "none-0.1ms", "gate-0.1ms", "idle", "idle-hook")


def _one(variant: str, num_ops: int, gap_s: float) -> dict:
    import torch

    torch.set_num_threads(1)
    sys.setswitchinterval(1e-4 if variant.endswith("0.1ms") else 5e-3)
    gate = variant.startswith("gate") or variant == "idle-hook"
    stepping = [False]
    step_over = threading.Event()
    step_over.set()

    def hook(frame, event, arg):
        if stepping[0] and event == "call":
            step_over.wait(0.05)

    built = threading.Event()
    build_s = [0.0]

    def build() -> None:
        if gate:
            sys.setprofile(hook)
        t0 = time.perf_counter()
        import torch._dynamo  # noqa: F401
        import torch._inductor.lowering  # noqa: F401
        import torch._inductor.pattern_matcher  # noqa: F401
        build_s[0] = time.perf_counter() - t0
        sys.setprofile(None)
        built.set()

    x = torch.zeros(16)

    def step() -> float:
        t0 = time.perf_counter()
        y = x
        for _ in range(num_ops):
            y = y + 1
        return time.perf_counter() - t0

    for _ in range(20):
        step()
    idle = [step() for _ in range(30)]
    thread = threading.Thread(target=build)
    thread.start()
    beside: list[float] = []
    while not variant.startswith("idle") and not built.is_set():
        stepping[0] = True
        step_over.clear()
        beside.append(step())
        stepping[0] = False
        step_over.set()
        time.sleep(gap_s)
    thread.join()
    out = {"variant": variant, "idle_step_ms": statistics.median(idle) * 1e3, "build_s": build_s[0],
           "steps": len(beside)}
    if beside:
        ordered = sorted(beside)
        out |= {"step_median_ms": statistics.median(beside) * 1e3,
                "step_p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3, "step_max_ms": ordered[-1] * 1e3}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=600, help="torch ops a step")
    p.add_argument("--gap-ms", type=float, default=2.0, help="idle between steps (the engine's host work)")
    p.add_argument("--rounds", type=int, default=2, help="times each variant runs, taking turns")
    p.add_argument("--out", default=None, help="directory for gil_gate-<cpu>.{json,md}")
    p.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.ops, args.gap_ms / 1e3)))
        return
    rows = []
    for r in range(args.rounds):
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--one", variant, "--ops", str(args.ops), "--gap-ms", str(args.gap_ms)]
            row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            rows.append(row | {"round": r})
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    cols = ["variant", "round", "idle_step_ms", "step_median_ms", "step_p90_ms", "step_max_ms", "steps", "build_s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.2f}" if isinstance(row.get(c), float) else str(row.get(c, ""))
                                       for c in cols) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        from kiln.bench.report import cpu_model

        cpu = cpu_model()
        name = "amd-epyc" if "EPYC" in cpu else "intel-xeon" if "Xeon" in cpu else "cpu"
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"cpu": cpu, "cores": os.cpu_count(), "ops": args.ops, "gap_ms": args.gap_ms,
                "python": platform.python_version()}
        (out / f"gil_gate-{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        header = (f"# Eager steps beside a build's imports, with and without a gate ({cpu}, {os.cpu_count()} cores)\n\n"
                  f"`python benchmarks/gil_gate.py --out benchmarks/results`: a step is {args.ops} torch ops "
                  f"on a 16-float tensor, {args.gap_ms} ms idle between steps, while a thread imports "
                  "Dynamo and Inductor; each variant a fresh process, the variants taking turns. "
                  "See the script's docstring for the variants and what this stands in for.\n\n")
        (out / f"gil_gate-{name}.md").write_text(header + table + "\n")


if __name__ == "__main__":
    main()
