"""The results layout: one summary per tool and card, ``results/<tool>-<card>.json`` and its ``.md``.

A summary is a JSON object of runs keyed by run name; a run holds any of

    {"records": [<kiln.bench.report record>, ...],   # or the raw JSON a tool printed
     "table": "<markdown: the run's table and notes>",
     "profile": "<profiler text>"}

A subcommand writes its files (``<run>.json`` records, ``<run>.md`` table, ``<run>.txt`` profile)
into ``$OUT``; ``fold`` then stores each stem as a run (``benchmarks.cli`` does this after a run
unless ``$OUT`` was set by the caller, as on a device machine: then ``python -m benchmarks.<tool>
fold <dir>`` stores what came back). ``save_run`` merges one run into its summary (a run of the
same name is replaced) and re-renders the ``.md``: one ``## <run>`` section per run, so ``<tool>-<card>.md#<run>`` and ``<tool>-<card>.json``
key ``<run>`` name the same measurement. Docs cite runs that way. The card is the accelerator's
model (``H100``, ``H200``) or ``cpu``; the machine is in each record's ``device``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from kiln.bench.report import device_name, format_number, records_table

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TOOLS = ("serve", "offline", "startup", "decode", "kernels", "bench")
# How docs name a run: ``decode-H200.md#static_decode-argmax`` (``*`` and ``{a,b}`` allowed in the run)
CITATION = re.compile(r"(?<![\w-])(" + "|".join(TOOLS) + r")-(cpu|[A-Z]{1,3}\d{2,4}[A-Za-z]?)\.(json|md)"
                      r"(?:#([A-Za-z0-9_.{},*+-]*[A-Za-z0-9_*}]))?")


def card_name(device: Optional[str] = None) -> str:
    """``H100`` for ``NVIDIA H100 80GB HBM3``, ``cpu`` for any CPU: the card part of a summary's name."""
    device = device_name() if device is None else device
    if device.startswith("cpu"):
        return "cpu"
    match = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]?)\b", device)
    return match.group(1) if match else re.sub(r"[^A-Za-z0-9]+", "", device)[:16]


def summary_path(tool: str, card: str, results_dir: Path | str = RESULTS_DIR) -> Path:
    if tool not in TOOLS:
        raise ValueError(f"tool={tool!r}; choose one of {list(TOOLS)}")
    return Path(results_dir) / f"{tool}-{card}.json"


def load_summary(tool: str, card: str, results_dir: Path | str = RESULTS_DIR) -> dict[str, dict]:
    path = summary_path(tool, card, results_dir)
    return json.loads(path.read_text()) if path.exists() else {}


def save_run(
    tool: str,
    run: str,
    records: Any = None,
    table: Optional[str] = None,
    profile: Optional[str] = None,
    card: Optional[str] = None,
    results_dir: Path | str = RESULTS_DIR,
) -> Path:
    """Store one run (its records, markdown table, profiler text) in ``<tool>-<card>.json`` and re-render the
    ``.md``; returns the JSON's path."""
    card = card or card_name()
    entry = {k: v for k, v in (("records", records), ("table", table), ("profile", profile)) if v is not None}
    summary = load_summary(tool, card, results_dir)
    summary[run] = entry
    return write_summary(tool, card, summary, results_dir)


def write_summary(tool: str, card: str, summary: dict[str, dict], results_dir: Path | str = RESULTS_DIR) -> Path:
    path = summary_path(tool, card, results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = dict(sorted(summary.items()))
    path.write_text(json.dumps(ordered, indent=1) + "\n")
    path.with_suffix(".md").write_text(render(tool, card, ordered))
    return path


def render(tool: str, card: str, summary: dict[str, dict]) -> str:
    lines = [f"# `python -m benchmarks.{tool}` on {card}", "",
             f"One section per run; its records are under the same key in `{tool}-{card}.json`.", ""]
    for run, entry in summary.items():
        lines += [f"## {run}", ""]
        if entry.get("table"):
            lines += [_demote_headings(entry["table"].rstrip()), ""]
        if entry.get("profile"):
            lines += ["```text", entry["profile"].rstrip(), "```", ""]
        records = entry.get("records")
        if records is not None and not entry.get("table"):
            lines += [_records_markdown(records, tool, card, run), ""]
    return "\n".join(lines)


def _records_markdown(records: Any, tool: str, card: str, run: str) -> str:
    """A table when the run holds ``kiln.bench.report`` records, else a pointer to the JSON."""
    records = [records] if isinstance(records, dict) else records
    shaped = isinstance(records, list) and records and all(
        isinstance(r, dict) and {"name", "model", "metrics", "status"} <= r.keys()
        and isinstance(r.get("config", {}), dict) and isinstance(r["metrics"], dict) for r in records)
    if not shaped:
        return f"Records: `{tool}-{card}.json`, key `{run}`."
    flat = all(not isinstance(v, (dict, list)) for r in records for v in r["metrics"].values())
    if flat and all(isinstance(r.get("config", {}).get("bench", {}), dict) for r in records):
        return records_table(records).rstrip()
    lines = []
    for r in records:  # nested metrics: one metric a line
        lines += [f"{r['name']}, {r['model']}, {r['device']}, {r['timestamp']}:", "",
                  "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {format_number(v)} |" for k, v in _flatten(r["metrics"]).items()] + [""]
    return "\n".join(lines).rstrip()


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def _demote_headings(text: str) -> str:
    """Headings inside a run's notes go two levels down, under the run's ``##``; fenced code is kept."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        out.append("##" + line if line.startswith("#") and not fenced else line)
    return "\n".join(out)


def find_run(tool: str, card: str, run: str, results_dir: Path | str = RESULTS_DIR) -> bool:
    """Whether ``run`` (a name, or a pattern with ``*`` or ``{a,b}``) names runs of that summary."""
    runs = load_summary(tool, card, results_dir)
    return all(any(_matches(name, pattern) for name in runs) for pattern in _expand(run))


def _expand(pattern: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [p for alt in match.group(1).split(",") for p in _expand(head + alt + tail)]


def _matches(name: str, pattern: str) -> bool:
    regex = "".join(".*" if c == "*" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name) is not None


KINDS = {".json": "records", ".md": "table", ".txt": "profile"}


def fold(tool: str, directory: Path | str, card: Optional[str] = None, results_dir: Path | str = RESULTS_DIR,
         remove: bool = False) -> list[Path]:
    """Store every ``<run>.{json,md,txt}`` under ``directory`` as run ``<run>`` of ``tool``'s summary
    for its card (the records' ``device``, else ``card``, else this machine's); returns the summaries
    written. ``remove`` deletes the folded files."""
    runs: dict[str, dict] = {}
    files = sorted(p for p in Path(directory).rglob("*") if p.is_file() and p.suffix in KINDS)
    for path in files:
        text = path.read_text()
        runs.setdefault(path.stem, {})[KINDS[path.suffix]] = json.loads(text) if path.suffix == ".json" else text
    by_card: dict[str, dict] = {}
    for run, entry in runs.items():
        by_card.setdefault(_record_card(entry.get("records")) or card or card_name(), {})[run] = entry
    written = []
    for run_card, entries in by_card.items():
        summary = load_summary(tool, run_card, results_dir)
        summary.update(entries)
        written.append(write_summary(tool, run_card, summary, results_dir))
    if remove:
        for path in files:
            path.unlink()
    return written


def _record_card(records: Any) -> Optional[str]:
    first = records[0] if isinstance(records, list) and records else records
    device = first.get("device") if isinstance(first, dict) else None
    return card_name(device) if isinstance(device, str) else None
