"""Helpers shared by the benchmark tools: where a run writes, timing, and the records of ``kiln bench``.

A subcommand builds one record per measured system with ``make_record`` (name, model, device, config,
metrics, status, error, timestamp, torch version; see ``kiln.bench.report``) and writes its files
into ``out_dir()`` (``$OUT``), e.g. with ``save_results``; ``benchmarks.cli`` then folds them into
the tool's summary (``benchmarks.results``). The sweep of ``kiln bench`` writes the same records, so
a tool's history and a sweep can be read, tabulated and plotted by the same code.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from kiln.bench.report import (  # noqa: F401  (re-exported for the scripts)
    append_table_rows, device_name, format_number, make_record, write_record,
)

REPO = Path(__file__).resolve().parents[1]


def out_dir() -> Path:
    """Where a run writes its files: ``$OUT`` (a fresh directory ``benchmarks.cli`` folds afterwards,
    or the caller's), else a new temporary directory."""
    out = os.environ.get("OUT") or tempfile.mkdtemp(prefix="kiln-bench-")
    os.environ["OUT"] = out
    return Path(out)


def child_command(module: str, *args: str) -> list[str]:
    """``python -m <module> <args>``: a fresh interpreter for one measurement (run it with ``child_env``)."""
    return [sys.executable, "-m", module, *args]


def child_env(env: Optional[dict] = None) -> dict:
    """``env`` (default: this process's) with the repository on ``PYTHONPATH``, so ``benchmarks`` imports."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def copy_bandwidth(num_bytes: int = 2**30, iters: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy (median of ``iters`` timed copies
    after a warm-up), the ceiling of a decode step that reads every weight once; on the CPU, a
    128 MiB memcpy. On the GPU the warm-up copies for half a second: with three copies only, one
    process on an H200 measured 3.94 TB/s where another in the same call measured about 4.18 (a
    guess: clocks not yet up), which overstated its percent of roofline by 6%."""
    import torch

    cuda = torch.cuda.is_available()
    num_bytes = num_bytes if cuda else 2**27
    x = torch.empty(num_bytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    if cuda:
        torch.cuda.synchronize()
        warm_until = time.perf_counter() + 0.5
        while time.perf_counter() < warm_until:
            for _ in range(10):
                y.copy_(x)
            torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y.copy_(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - t0)
    del x, y
    return 2 * num_bytes / sorted(times)[iters // 2]


def timed_generate(llm, prompts: list[list[int]], max_tokens: int, **generate_kwargs) -> float:
    """Seconds for ``llm`` to generate exactly ``max_tokens`` greedy tokens for every prompt
    (``generate_kwargs``: more of ``LLM.generate``'s, e.g. ``lora_request``)."""
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, **generate_kwargs)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return elapsed


def weight_bytes_per_step(model) -> int:
    """Bytes one decode step reads of a kiln model: its parameters and quantized weight buffers,
    all but the embedding table unless it is the tied LM head (a step reads one row of it)."""
    from kiln.models.quantize import QuantLinear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, QuantLinear)
                 for b in (m.qweight, m.scales))
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    if model.lm_head is not None:
        total -= nbytes(model.embed_tokens.weight)
    head = getattr(model, "head_weight", None)  # the LM head's copy a step reads instead (CPU, quantized)
    if head is not None:
        q8 = getattr(model, "head_q8", None)  # one row reads the Q8_0 copy instead (kiln.ops.cpu_linear)
        read = nbytes(head) if q8 is None else nbytes(q8.qweight) + nbytes(q8.scales)
        total += read - nbytes(model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight)
    return total


def mean_us(call, iters: int) -> float:
    """Mean microseconds of ``call()`` over ``iters`` calls, after three untimed ones."""
    for _ in range(3):
        call()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters * 1e6


@contextmanager
def timed() -> Iterator[dict]:
    """``with timed() as t: ...`` then ``t["s"]`` holds the elapsed seconds."""
    box: dict = {}
    t0 = time.perf_counter()
    try:
        yield box
    finally:
        box["s"] = time.perf_counter() - t0


def stop_process(proc, timeout: float = 60.0) -> None:
    """Ask a server process to stop (SIGTERM, so it drains), killing it if it has not within ``timeout`` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def save_results(
    name: str,
    records: list[dict],
    results_dir: Optional[Path] = None,
    config_keys: Optional[list[str]] = None,
) -> tuple[list[Path], Path]:
    """Write one JSON per record (run ``<name>-<system>-<time>``) and their rows to
    ``<name>-<time>.md`` (run ``<name>-<time>``) under ``results_dir`` (default ``out_dir()``)."""
    results_dir = Path(results_dir) if results_dir is not None else out_dir()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_paths = []
    for record in records:
        system = record.get("config", {}).get("system", "run")
        json_paths.append(write_record(record, results_dir / f"{name}-{system}-{stamp}.json"))
    table = append_table_rows(results_dir / f"{name}-{stamp}.md", records, config_keys)
    return json_paths, table


def console_table(header: list[str], rows: list[list]) -> str:
    """A plain aligned text table for the terminal."""
    cells = [[str(h) for h in header]] + [[format_number(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """The lines of a markdown table (cells as given, str()-ed)."""
    return ["| " + " | ".join(map(str, header)) + " |", "|" + " --- |" * len(header),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]
