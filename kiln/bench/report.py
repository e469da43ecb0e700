"""Benchmark results: one JSON record per run, and markdown tables over any set of records.

Every kiln benchmark writes this one format (the ``kiln bench`` sweep and the scripts in
``benchmarks/`` tools), so any set of runs can be tabulated and plotted together::

    {"name": "bench-throughput", "model": "random:tiny", "device": "cpu: <cpu model>",
     "config": {...}, "metrics": {"startup_s": 1.9, "output_tok_s_bs8": 412.0, ...},
     "status": "ok" | "error" | "skipped", "error": null | "<one-line reason>",
     "timestamp": "2025-01-01T12:00:00+00:00", "torch_version": "2.x"}

Rules kept here: metrics are flat ``name -> number`` with the unit in the name (``_s``, ``_ms``,
``_tok_s``), per-batch-size metrics end in ``_bs<N>``; a record that is not "ok" says why in ``error``.
Plots live in ``kiln.bench.plots``; this module imports neither torch nor matplotlib at import time.
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Any, Iterable, Optional

RESULT_FILE = "result.json"  # the record of one sweep job, in that job's directory
TABLE_FILE = "results.md"
STATUSES = ("ok", "error", "skipped")


def device_name() -> str:
    """The accelerator's name, else the CPU model: what a number was measured on."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu: {cpu_model()}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def make_record(
    name: str,
    model: str,
    config: dict,
    metrics: Optional[dict] = None,
    status: str = "ok",
    error: Optional[str] = None,
) -> dict:
    """One result record (see the module docstring); ``error`` is required unless status is ok."""
    import torch

    if status not in STATUSES:
        raise ValueError(f"status={status!r} is not allowed; choose one of {list(STATUSES)}")
    if status != "ok" and not error:
        raise ValueError(f"a record with status={status!r} must say why in error")
    return {
        "name": name,
        "model": model,
        "device": device_name(),
        "config": config,
        "metrics": dict(metrics or {}),
        "status": status,
        "error": error,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
    }


def write_record(record: dict, path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path


def load_records(root: Path | str) -> list[dict]:
    """Every sweep record under ``root`` (``*/result.json``), in job order."""
    paths = sorted(Path(root).rglob(RESULT_FILE), key=lambda p: _job_order(p.parent.name))
    return [json.loads(p.read_text()) for p in paths]


def _job_order(dirname: str) -> tuple:
    head = dirname.split("_", 1)[0]
    return (int(head), dirname) if head.isdigit() else (1 << 30, dirname)


def run_label(record: dict, with_model: bool = False) -> str:
    """``mode/cudagraph`` of a sweep record (plus the model when a table mixes models)."""
    compile_cfg = record.get("config", {}).get("compile", {})
    label = f"{compile_cfg.get('mode', '?')}/{compile_cfg.get('cudagraph', '?')}" if compile_cfg else record["name"]
    return f"{label} {record['model']}" if with_model else label


def format_number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _metric_columns(records: Iterable[dict]) -> list[str]:
    first = ["startup_s", "server_startup_s", "warmup_s"]
    seen: dict[str, None] = {}
    for r in records:
        for key, value in r.get("metrics", {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                seen.setdefault(key)
    return [k for k in first if k in seen] + [k for k in seen if k not in first]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def records_table(records: list[dict]) -> str:
    """A markdown table with one row per record and one column per numeric metric."""
    with_model = len({r["model"] for r in records}) > 1
    metrics = _metric_columns(records)
    header = ["run", "model", "bench", "status", *metrics, "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        bench = r.get("config", {}).get("bench", {}).get("kind", r["name"])
        values = [format_number(r["metrics"][m]) if m in r["metrics"] else "" for m in metrics]
        note = (r.get("error") or "")[:160]
        row = [run_label(r, with_model), r["model"], bench, r["status"], *values, note]
        lines.append("| " + " | ".join(_cell(str(c)) for c in row) + " |")
    return "\n".join(lines) + "\n"


def write_table(records: list[dict], path: Path | str, title: str = "Benchmark results") -> Path:
    path = Path(path)
    devices = sorted({r["device"] for r in records})
    head = f"# {title}\n\nDevice: {', '.join(devices) or 'n/a'}\n\n"
    path.write_text(head + (records_table(records) if records else "No runs.\n"))
    return path


_LOG_HEADER = ["timestamp", "name", "model", "device", "config", "status", "metrics"]


def append_table_rows(path: Path | str, records: list[dict], config_keys: Optional[list[str]] = None) -> Path:
    """Append one row per record to a running markdown log (header written on first use).

    Unlike ``records_table`` the columns are fixed, so records with different metrics can share one file.
    ``config_keys`` (dotted) picks which config entries to show; by default every scalar one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    if not path.exists() or not path.read_text().strip():
        lines += ["| " + " | ".join(_LOG_HEADER) + " |", "|" + "---|" * len(_LOG_HEADER)]
    for r in records:
        config = _flatten(r.get("config", {}))
        if config_keys is not None:
            config = {k: config[k] for k in config_keys if k in config}
        shown_config = ", ".join(f"{k}={v}" for k, v in config.items())
        if r["status"] == "ok":
            shown_metrics = ", ".join(f"{k}={format_number(v)}" for k, v in r["metrics"].items())
        else:
            shown_metrics = f"{r['status']}: {r.get('error')}"
        row = [r["timestamp"], r["name"], r["model"], r["device"], shown_config, r["status"], shown_metrics]
        lines.append("| " + " | ".join(_cell(str(c)) for c in row) + " |")
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _flatten(d: dict, prefix: str = "") -> dict:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
