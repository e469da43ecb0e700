"""A non-editable install works: the wheel carries kiln's Hydra YAML (``kiln/configs/``) and the
installed ``kiln`` composes its config from there, never from a checkout.

The wheel is built from a copy of the sources (so the checkout's ``build/`` and ``*.egg-info`` are
left alone) with ``KILN_SKIP_EXTENSION=1``: the C++ extension is not what this checks, and building
it would take minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
GROUPS = ("model", "compile", "cache", "scheduler", "server", "parallel", "bench")


def run(cmd: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "kiln", src / "kiln", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "KILN_SKIP_EXTENSION": "1"}
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(src)], cwd=src, env=env)
    (path,) = out.glob("kiln-*.whl")
    return path


def test_wheel_carries_the_configs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kiln/configs/config.yaml" in names
    for group in ("model_preset", *GROUPS[1:]):  # the YAML folders; presets fill model.*
        assert any(n.startswith(f"kiln/configs/{group}/") and n.endswith(".yaml") for n in names), group
    assert {"kiln/configs/model_preset/tiny-random.yaml", "kiln/configs/compile/eager.yaml"} <= names
    assert "kiln/bench/sweep.py" in names and "kiln/bench/worker.py" in names
    assert not any(n.startswith("configs/") for n in names)  # nothing outside the package


def test_installed_kiln_prints_composed_config(wheel, tmp_path):
    site, cwd = tmp_path / "site", tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
         str(wheel)], cwd=cwd, env=env)
    # The checkout's editable install stays on sys.meta_path after PYTHONPATH, so the copy under
    # `site` wins; the child says which kiln it imported, on stderr, apart from the config on stdout.
    code = ("import sys, kiln; print('KILN_FILE=' + kiln.__file__, file=sys.stderr); "
            "from kiln.entrypoints.cli import main; main(['serve', '--cfg', 'job'])")
    res = run([sys.executable, "-c", code], cwd=cwd, env={**env, "PYTHONPATH": str(site)})
    kiln_file = next(line for line in res.stderr.splitlines() if line.startswith("KILN_FILE="))
    assert Path(kiln_file.removeprefix("KILN_FILE=")).resolve().is_relative_to(site.resolve()), kiln_file
    printed = yaml.safe_load(res.stdout)
    assert printed["model"]["model"] == "smollm2-135m-instruct"
    assert printed["compile"]["mode"] and set(GROUPS) <= set(printed)
    assert not (cwd / "outputs").exists()
