"""`kiln bench`: one benchmark run per Hydra job, each measured in a fresh process.

    kiln bench -m compile.mode=eager,stock,kiln compile.cudagraph=none,piecewise,full bench=throughput

Hydra expands the sweep into jobs; each job (``run_job``) either records why its combination does not
apply on this machine (``skip_reason``), or runs ``kiln.bench.worker`` in a subprocess, so
compile caches, Inductor state and memory never bleed from one combination into the next. A worker
that raises still writes its record (status "error"); one that dies or times out gets one written
here. After every job the sweep's table and plots are rewritten, so an interrupted sweep still
leaves a report of the runs it finished.

Layout of a sweep directory::

    <sweep dir>/
      0_compile.cudagraph=none,compile.mode=eager/   result.json  spec.json  (error.txt)
      1_.../
      results.md  throughput.png  latency.png  startup.png
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kiln.bench.report import (
    RESULT_FILE, TABLE_FILE, format_number, load_records, make_record, run_label, write_record, write_table,
)
from kiln.config import EngineConfig, redacted

BENCH_KINDS = ("throughput", "latency", "serve", "startup")


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run measures (kiln/configs/bench/*.yaml)."""

    kind: str = "throughput"  # throughput | latency | serve | startup
    batch_sizes: tuple[int, ...] = (1, 8, 32)  # concurrent requests per measured point
    prompt_len: int = 128  # tokens per prompt (random ids, fixed length)
    output_len: int = 64  # tokens per output (ignore_eos, so every request runs this long)
    num_requests: int = 16  # throughput/serve: at least this many requests per batch size
    num_iters: int = 5  # latency: timed requests; startup: fresh processes
    seed: int = 0  # prompt token ids
    timeout_s: float = 1800.0  # one worker process, start-up included

    def __post_init__(self) -> None:
        if self.kind not in BENCH_KINDS:
            raise ValueError(f"bench.kind={self.kind!r} is not allowed; choose one of {list(BENCH_KINDS)}")
        object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(
                f"bench.batch_sizes must be a non-empty list of integers >= 1, got {list(self.batch_sizes)}"
            )
        for name in ("prompt_len", "output_len", "num_requests", "num_iters", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class JobPaths:
    """Where one job writes (its own directory) and where the sweep's report goes."""

    job_dir: Path
    report_dir: Path


def skip_reason(config: EngineConfig) -> Optional[str]:
    """Why this combination cannot run on this machine, or None when it can."""
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if config.compile.cudagraph not in ("none", "auto") and num_gpus == 0:
        return f"compile.cudagraph={config.compile.cudagraph} needs CUDA; this machine has no GPU"
    if config.model.device == "cuda" and num_gpus == 0:
        return "model.device=cuda but this machine has no GPU"
    if config.parallel.tensor_parallel_size > max(num_gpus, 1):
        tp = config.parallel.tensor_parallel_size
        return f"parallel.tensor_parallel_size={tp} needs that many GPUs; found {num_gpus}"
    return None


def run_job(engine: EngineConfig, bench: BenchConfig, paths: JobPaths) -> dict:
    """Measure one combination (or record why not), write its record and refresh the sweep report."""
    paths.job_dir.mkdir(parents=True, exist_ok=True)
    # Records and specs hold the redacted config; a worker gets the secrets in its environment.
    config = {**redacted(engine), "bench": dataclasses.asdict(bench)}
    env = {**os.environ, **engine.server.secret_env()}
    spec = {"name": f"bench-{bench.kind}", "model": engine.model.model, "config": config}
    result_path = paths.job_dir / RESULT_FILE
    reason = skip_reason(engine)
    if reason is not None:
        record = make_record(spec["name"], spec["model"], config, status="skipped", error=reason)
        write_record(record, result_path)
    elif bench.kind == "startup":
        record = _run_startup(spec, bench, paths.job_dir, env)
    else:
        record = _run_worker(spec, bench.timeout_s, paths.job_dir, env)
    print(summary_line(record), flush=True)
    write_report(paths.report_dir)
    return record


def _run_worker(spec: dict, timeout_s: float, job_dir: Path, env: dict, tag: str = "") -> dict:
    spec_path = job_dir / f"spec{tag}.json"
    result_path = job_dir / (f"result{tag}.json" if tag else RESULT_FILE)
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "kiln.bench.worker", str(spec_path), str(result_path)]
    # stdout/stderr pass through: the worker's progress bars are the sweep's progress bars.
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, env=env)
        died = None if result_path.exists() else _death_reason(proc.returncode)
    except subprocess.TimeoutExpired:
        died = f"timed out after {timeout_s:g} s (raise bench.timeout_s)"
    if died is not None:
        record = make_record(spec["name"], spec["model"], spec["config"], status="error", error=died)
        write_record(record, result_path)
        return record
    return json.loads(result_path.read_text())


def _death_reason(returncode: int) -> str:
    if returncode < 0:
        return f"worker killed by signal {-returncode} (out of memory?) before writing its result"
    return f"worker exited with code {returncode} before writing its result"


def _run_startup(spec: dict, bench: BenchConfig, job_dir: Path, env: dict) -> dict:
    """Start-up is measured in ``num_iters`` fresh processes: the first may fill the on-disk caches."""
    runs = [_run_worker(spec, bench.timeout_s, job_dir, env, tag=f"-{i}") for i in range(bench.num_iters)]
    failed = next((r for r in runs if r["status"] != "ok"), None)
    if failed is not None:
        record = failed
    else:
        times = [r["metrics"]["startup_s"] for r in runs]
        metrics = {"startup_s": times[0], **{f"startup_s_run{i}": t for i, t in enumerate(times)}}
        if len(times) > 1:
            metrics["startup_warm_s"] = min(times[1:])
        metrics["first_generate_s"] = runs[0]["metrics"].get("first_generate_s")
        record = make_record(spec["name"], spec["model"], spec["config"], metrics)
    write_record(record, job_dir / RESULT_FILE)
    return record


def summary_line(record: dict) -> str:
    label = run_label(record)
    if record["status"] != "ok":
        return f"[bench] {label}: {record['status']}: {record['error']}"
    shown = list(record["metrics"].items())[:6]
    return f"[bench] {label}: ok " + ", ".join(f"{k}={format_number(v)}" for k, v in shown)


def write_report(report_dir: Path) -> list[Path]:
    """Rewrite the table and plots of every record under ``report_dir``."""
    from kiln.bench.plots import MISSING_MATPLOTLIB, write_plots

    records = load_records(report_dir)
    table = write_table(records, report_dir / TABLE_FILE, title="kiln bench")
    plots = write_plots(records, report_dir)
    if not plots:
        print(f"[bench] {MISSING_MATPLOTLIB}", flush=True)
    return [table, *plots]
