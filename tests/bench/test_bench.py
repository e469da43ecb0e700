"""``kiln bench``: the results format, skips, worker failures, and a tiny sweep on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.bench import worker as bench_worker
from kiln.bench.plots import PLOT_FILES, write_plots
from kiln.bench.report import (
    RESULT_FILE, TABLE_FILE, append_table_rows, load_records, make_record, records_table, write_record,
)
from kiln.bench.sweep import BenchConfig, skip_reason, write_report
from kiln.config import CompileConfig, EngineConfig, ModelConfig
from tests.helpers.paths import REPO

COMPILE = {"compile": {"mode": "eager", "cudagraph": "none"}}


def test_record_format():
    rec = make_record("bench-throughput", "random:tiny", COMPILE, {"startup_s": 1.5, "output_tok_s_bs8": 410.2})
    assert set(rec) == {"name", "model", "device", "config", "metrics", "status", "error", "timestamp",
                        "torch_version"}
    assert rec["status"] == "ok" and rec["torch_version"] == torch.__version__ and rec["device"]
    with pytest.raises(ValueError, match="must say why"):
        make_record("x", "m", {}, status="error")
    with pytest.raises(ValueError, match="status='maybe'"):
        make_record("x", "m", {}, status="maybe", error="?")


def test_table_has_a_row_and_column_per_run_and_metric(tmp_path):
    ok = make_record("bench-throughput", "random:tiny", COMPILE, {"startup_s": 1.5, "output_tok_s_bs8": 410.2})
    skipped = make_record("bench-throughput", "random:tiny", {"compile": {"mode": "kiln", "cudagraph": "full"}},
                          status="skipped", error="compile.cudagraph=full needs CUDA")
    table = records_table([ok, skipped]).splitlines()
    assert table[0] == "| run | model | bench | status | startup_s | output_tok_s_bs8 | note |"
    assert table[2].startswith("| eager/none | random:tiny |") and "| 410 |" in table[2]
    assert "kiln/full" in table[3] and "needs CUDA" in table[3]

    log = tmp_path / "log.md"
    append_table_rows(log, [ok])
    append_table_rows(log, [skipped])
    lines = log.read_text().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| timestamp |")  # one header, two rows
    assert "output_tok_s_bs8=410" in lines[2] and "skipped: compile.cudagraph=full" in lines[3]


def test_plots_written_even_without_data(tmp_path):
    latency = make_record("bench-latency", "random:tiny", COMPILE,
                          {"startup_s": 1.0, "ttft_ms_p50": 20.0, "ttft_ms_p99": 30.0, "tpot_ms_p50": 5.0})
    paths = write_plots([latency], tmp_path)
    assert [p.name for p in paths] == list(PLOT_FILES)
    assert all(p.stat().st_size > 1000 for p in paths)


def test_sweep_report_without_matplotlib_says_how_to_get_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    ok = make_record("bench-throughput", "random:tiny", COMPILE, {"startup_s": 1.5, "output_tok_s_bs8": 410.2})
    write_record(ok, tmp_path / "0_eager" / RESULT_FILE)
    assert write_report(tmp_path) == [tmp_path / TABLE_FILE]
    assert not any((tmp_path / name).exists() for name in PLOT_FILES)
    assert "matplotlib is not installed (pip install 'kiln[bench]')" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only skip")
def test_cudagraph_combinations_skip_without_cuda():
    assert skip_reason(EngineConfig()) is None
    reason = skip_reason(EngineConfig(compile=CompileConfig(mode="kiln", cudagraph="piecewise")))
    assert reason == "compile.cudagraph=piecewise needs CUDA; this machine has no GPU"


def test_worker_records_a_failure_instead_of_raising(tmp_path):
    config = {"model": {"model": "random:no-such-preset"}, "bench": {"kind": "throughput", "batch_sizes": [1]}}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "bench-throughput", "model": "random:no-such-preset", "config": config}))
    assert bench_worker.main([str(spec), str(tmp_path / RESULT_FILE)]) == 1
    rec = json.loads((tmp_path / RESULT_FILE).read_text())
    assert rec["status"] == "error" and "no-such-preset" in rec["error"] and rec["metrics"] == {}
    assert "Traceback" in (tmp_path / "error.txt").read_text()


def test_bench_config_validates():
    with pytest.raises(ValueError, match=r"bench\.batch_sizes"):
        BenchConfig(batch_sizes=())
    with pytest.raises(ValueError, match=r"bench\.kind='soak'"):
        BenchConfig(kind="soak")


# ~35 s, a worker process per run; the records, table, plots, worker and compile modes are tested apart.
@pytest.mark.slow
def test_tiny_sweep_writes_records_table_and_plots(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-m", "kiln.entrypoints.cli", "bench", "-m",
         "compile.mode=eager,stock", "compile.cudagraph=none,piecewise", "model=tiny-random",
         "bench.batch_sizes=[1,2]", "bench.prompt_len=8", "bench.output_len=4", "bench.num_requests=2",
         f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    records = load_records(sweep)
    assert len(records) == 4 and len(list(sweep.glob(f"*/{RESULT_FILE}"))) == 4
    by_run = {(r["config"]["compile"]["mode"], r["config"]["compile"]["cudagraph"]): r for r in records}
    assert set(by_run) == {("eager", "none"), ("eager", "piecewise"), ("stock", "none"), ("stock", "piecewise")}
    for rec in records:  # each run has numbers, or says why not
        assert (rec["status"] == "ok" and rec["metrics"]) or (rec["status"] in ("error", "skipped") and rec["error"])
    eager = by_run[("eager", "none")]
    assert eager["status"] == "ok", eager["error"]
    assert {"startup_s", "warmup_s", "output_tok_s_bs1", "output_tok_s_bs2"} <= set(eager["metrics"])
    if not torch.cuda.is_available():
        assert by_run[("eager", "piecewise")]["status"] == "skipped"
        assert "needs CUDA" in res.stdout
    table = (sweep / TABLE_FILE).read_text()
    assert table.count("| random:tiny |") == 4 and "eager/none" in table and "stock/none" in table
    assert all((sweep / name).stat().st_size > 1000 for name in PLOT_FILES)
