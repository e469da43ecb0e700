"""``benchmarks/``: every tool and subcommand answers ``--help``, runs fold into one summary per tool
and card, and every results run the docs cite exists."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import results
from benchmarks.cli import run
from tests.helpers.paths import REPO

TOOLS = ("serve", "offline", "startup", "decode", "kernels")


def _subcommands(tool: str) -> dict:
    return importlib.import_module(f"benchmarks.{tool}.__main__").SUBCOMMANDS


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help_lists_its_subcommands(tool):
    out = subprocess.run([sys.executable, "-m", f"benchmarks.{tool}", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert all(f"  {name} " in out.stdout for name in [*_subcommands(tool), "fold"])


@pytest.mark.parametrize("tool", TOOLS)
def test_every_subcommand_answers_help(tool):
    for name in [*_subcommands(tool), "fold"]:
        with contextlib.redirect_stdout(io.StringIO()) as shown, pytest.raises(SystemExit) as exit_:
            run(tool, "", _subcommands(tool), [name, "--help"])
        assert exit_.value.code == 0, f"{tool} {name}"
        assert f"python -m benchmarks.{tool} {name}" in shown.getvalue()


def test_an_unknown_subcommand_is_refused():
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert run("decode", "", _subcommands("decode"), ["nope"]) == 2
    assert "unknown subcommand 'nope'" in err.getvalue()


def test_fold_stores_each_stem_as_a_run_of_its_card(tmp_path):
    out, store = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    (out / "static-argmax.json").write_text(json.dumps({"device": "NVIDIA H200", "ms_per_step": 4.19}))
    (out / "static-argmax.md").write_text("# A table\n\n| a |\n|---|\n| 1 |\n")
    (out / "probe.txt").write_text("kernel  us\n")
    written = results.fold("decode", out, card="cpu", results_dir=store, remove=True)
    assert sorted(p.name for p in written) == ["decode-H200.json", "decode-cpu.json"]
    h200 = results.load_summary("decode", "H200", store)
    assert h200["static-argmax"]["records"]["ms_per_step"] == 4.19
    assert "### A table" in (store / "decode-H200.md").read_text()  # under the run's own heading
    assert results.load_summary("decode", "cpu", store)["probe"] == {"profile": "kernel  us\n"}
    assert results.find_run("decode", "H200", "static-{argmax}", store)
    assert not results.find_run("decode", "H200", "static-rerun", store)
    assert not any(out.iterdir())


def test_card_names():
    assert results.card_name("NVIDIA H100 80GB HBM3") == "H100"
    assert results.card_name("NVIDIA H200") == "H200"
    assert results.card_name("cpu: AMD EPYC 7B13") == "cpu"


def _cited_runs() -> list[tuple[str, str]]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [(str(path.relative_to(REPO)), m.group(0)) for path in docs
            for m in results.CITATION.finditer(path.read_text())]


def test_every_cited_results_run_exists():
    cited = _cited_runs()
    assert len(cited) > 50  # the docs cite their records this way
    missing = []
    for doc, citation in cited:
        tool, card, ext, run_name = results.CITATION.fullmatch(citation).groups()
        path = results.summary_path(tool, card).with_suffix(f".{ext}")
        if not path.exists() or (run_name and not results.find_run(tool, card, run_name)):
            missing.append(f"{doc}: {citation}")
    assert not missing


def test_results_hold_only_summaries():
    names = {p.name for p in Path(results.RESULTS_DIR).iterdir()}
    stray = {n for n in names if not results.CITATION.fullmatch(n)}
    assert not stray
