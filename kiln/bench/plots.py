"""Plots over a set of benchmark records (see ``kiln.bench.report`` for the record format).

Three figures, always written so a sweep directory has a fixed layout (a figure with no data says so):

- ``throughput.png``: output tokens/s against batch size, one line per run (``output_tok_s_bs<N>``);
- ``latency.png``: latency percentiles per run (``*_ms_p50`` / ``_p90`` / ``_p99``);
- ``startup.png``: start-up (engine construction incl. compile) and warm-up time per run.

matplotlib is imported inside ``write_plots`` with the Agg backend, so nothing needs a display. It
is optional (``pip install 'kiln[bench]'``): without it ``write_plots`` writes nothing, and the sweep
says so (``MISSING_MATPLOTLIB``); its table still holds every number.
"""

from __future__ import annotations

import re
from pathlib import Path

from kiln.bench.report import run_label

_BATCH_METRIC = re.compile(r"^output_tok_s_bs(\d+)$")
_PERCENTILE_METRIC = re.compile(r"^(\w+)_ms_p(\d+)$")
_TIME_METRICS = ("startup_s", "compile_s", "warmup_s", "server_startup_s")
PLOT_FILES = ("throughput.png", "latency.png", "startup.png")
MISSING_MATPLOTLIB = "no plots: matplotlib is not installed (pip install 'kiln[bench]'); the table has every number"


def write_plots(records: list[dict], out_dir: Path | str) -> list[Path]:
    """The figures of ``PLOT_FILES`` in ``out_dir``; none (an empty list) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    ok = [r for r in records if r["status"] == "ok"]
    with_model = len({r["model"] for r in records}) > 1
    paths = []
    for filename, draw in zip(PLOT_FILES, (_throughput, _latency, _startup)):
        fig = plt.figure(figsize=(7, 4.5))
        if not draw(fig, ok, with_model):
            fig.clear()
            fig.text(0.5, 0.5, f"{filename[:-4]}: no successful runs with these metrics", ha="center", va="center")
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=110)
        plt.close(fig)
        paths.append(out_dir / filename)
    return paths


def _throughput(fig, records: list[dict], with_model: bool) -> bool:
    ax = fig.add_subplot()
    drawn, batch_sizes = False, set()
    for r in records:
        points = sorted(
            (int(m.group(1)), value)
            for key, value in r["metrics"].items()
            if (m := _BATCH_METRIC.match(key))
        )
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=run_label(r, with_model))
            drawn, batch_sizes = True, batch_sizes | set(xs)
    if drawn:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(batch_sizes), [str(b) for b in sorted(batch_sizes)])
        ax.minorticks_off()
        ax.set_xlabel("batch size (concurrent requests)")
        ax.set_ylabel("output tokens / s")
        ax.set_title("Throughput")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return drawn


def _latency(fig, records: list[dict], with_model: bool) -> bool:
    # One panel per latency family (ttft, tpot, e2e, ...): their scales differ by orders of magnitude.
    families: dict[str, dict[str, dict[str, float]]] = {}  # family -> percentile -> run -> ms
    for r in records:
        for key, value in r["metrics"].items():
            if m := _PERCENTILE_METRIC.match(key):
                families.setdefault(m.group(1), {}).setdefault(f"p{m.group(2)}", {})[run_label(r, with_model)] = value
    if not families:
        return False
    runs = [run_label(r, with_model) for r in records]
    axes = fig.subplots(1, len(families), squeeze=False)[0]
    for ax, (family, by_percentile) in zip(axes, sorted(families.items())):
        order = sorted(by_percentile, key=lambda p: int(p[1:]))
        _bars(ax, runs, {p: [by_percentile[p].get(run, 0.0) for run in runs] for p in order})
        ax.set_title(f"{family} (ms)")
    fig.suptitle("Latency percentiles")
    return True


def _startup(fig, records: list[dict], with_model: bool) -> bool:
    ax = fig.add_subplot()
    runs = [run_label(r, with_model) for r in records]
    present = [m for m in _TIME_METRICS if any(m in r["metrics"] for r in records)]
    if not present:
        return False
    _bars(ax, runs, {m: [r["metrics"].get(m, 0.0) for r in records] for m in present})
    ax.set_ylabel("seconds")
    ax.set_title("Start-up (engine construction incl. compile) and warm-up")
    return True


def _bars(ax, groups: list[str], values: dict[str, list[float]]) -> None:
    width = 0.8 / max(1, len(values))
    for i, (name, ys) in enumerate(values.items()):
        xs = [g + i * width - 0.4 + width / 2 for g in range(len(groups))]
        ax.bar(xs, ys, width=width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
