"""The ``kiln`` command: Hydra composition, overrides, clean errors, and each subcommand end to end."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from kiln.config import EngineConfig
from kiln.entrypoints import cache_cmd
from kiln.entrypoints.cli import CONFIG_DIR, CliConfig, engine_config, register_configs
from kiln.runtime.worker import free_port

REPO = Path(__file__).resolve().parents[1]


def composed(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def kiln(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "kiln.entrypoints.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---- composition (in process, Hydra's compose API) -------------------------------------------
def test_defaults_compose_into_typed_configs():
    cli = OmegaConf.to_object(composed([]))
    assert isinstance(cli, CliConfig)
    assert cli.model.model == "smollm2-135m-instruct"
    assert (cli.compile.mode, cli.compile.cudagraph) == ("eager", "none")
    assert cli.bench.kind == "throughput" and cli.bench.batch_sizes == (1, 8, 32)
    assert cli.chat is True and cli.prompt
    engine = engine_config(cli)
    assert isinstance(engine, EngineConfig) and engine.compile is cli.compile


def test_groups_and_overrides():
    cfg = composed(["model=tiny-random", "compile=kiln-piecewise", "server.port=9001", "bench=latency",
                    "compile.capture_sizes=[4,1,2]", "cache.block_size=32", "prompt=Hi there"])
    cli = OmegaConf.to_object(cfg)
    assert cli.model.model == "random:tiny"
    assert (cli.compile.mode, cli.compile.cudagraph) == ("kiln", "piecewise")
    assert cli.compile.capture_sizes == (1, 2, 4)  # the dataclass sorts and stores a tuple
    assert cli.server.port == 9001 and cli.cache.block_size == 32
    assert cli.bench.kind == "latency" and cli.prompt == "Hi there"


def test_every_option_of_every_group_composes(monkeypatch):
    monkeypatch.setenv("KILN_HF_DIR", "/some/hf/dir")
    groups = {p.name: sorted(q.stem for q in p.glob("*.yaml")) for p in CONFIG_DIR.iterdir() if p.is_dir()}
    assert set(groups) == {"model", "compile", "cache", "scheduler", "server", "parallel", "bench"}
    assert {"eager", "stock", "kiln", "kiln-piecewise", "kiln-full"} <= set(groups["compile"])
    assert {"throughput", "latency", "serve", "startup"} <= set(groups["bench"])
    for group, options in groups.items():
        for option in options:
            assert isinstance(OmegaConf.to_object(composed([f"{group}={option}"])), CliConfig), (group, option)
    assert OmegaConf.to_object(composed(["model=hf-local"])).model.model == "/some/hf/dir"


def test_bad_value_names_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"compile\.mode='fast'.*\['eager', 'stock', 'kiln'\]"):
        OmegaConf.to_object(composed(["compile.mode=fast"]))
    with pytest.raises(ValueError, match=r"bench\.kind"):
        OmegaConf.to_object(composed(["bench.kind=soak"]))


def test_unknown_key_and_wrong_type_refused_at_composition():
    with pytest.raises(ConfigCompositionException):
        composed(["compile.bogus=1"])
    with pytest.raises(ConfigCompositionException):
        composed(["server.port=eighty"])


# ---- the command line (subprocess) -----------------------------------------------------------
def test_cfg_job_prints_composed_config(tmp_path):
    res = kiln("serve", "--cfg", "job", "model=tiny-random", "compile.mode=kiln", "server.port=8123", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    printed = yaml.safe_load(res.stdout)
    assert printed["model"]["model"] == "random:tiny"
    assert printed["compile"]["mode"] == "kiln" and printed["server"]["port"] == 8123
    assert not (tmp_path / "outputs").exists()


def test_wrong_override_fails_with_one_clear_line(tmp_path):
    res = kiln("generate", "compile.mode=fast", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert res.returncode == 2
    assert "compile.mode='fast'" in res.stderr and "['eager', 'stock', 'kiln']" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_help_lists_commands_groups_and_options(tmp_path):
    top = kiln("--help", cwd=tmp_path)
    assert top.returncode == 0
    assert all(c in top.stdout for c in ("serve", "generate", "bench", "cache", "compile:", "kiln-piecewise"))
    sub = kiln("generate", "--help", cwd=tmp_path)
    assert sub.returncode == 0
    assert "== Configuration groups ==" in sub.stdout and "compile: eager, kiln" in sub.stdout
    assert "max_tokens: 64" in sub.stdout
    assert kiln("fly", cwd=tmp_path).returncode == 2


def test_console_script_is_installed(tmp_path):
    script = Path(sys.executable).parent / "kiln"
    if not script.exists():
        pytest.skip("kiln is not installed in this environment (pip install -e .)")
    res = subprocess.run([str(script), "generate", "--cfg", "job", "model=tiny-random"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout)["model"]["model"] == "random:tiny"


def test_generate_prints_text(tmp_path):
    res = kiln("generate", "model=tiny-random", "prompt=Tell me a joke", "max_tokens=6", "chat=false",
               f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip(), "generate printed no text"
    assert "[INFO]" not in res.stdout  # logs go to stderr; stdout is the text only


@pytest.mark.skipif(importlib.util.find_spec("kiln.entrypoints.openai.api_server") is None,
                    reason="the OpenAI server (kiln.entrypoints.openai) is not in this tree yet")
def test_serve_answers_health(tmp_path):
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.entrypoints.cli", "serve", "model=tiny-random", f"server.port={port}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline, status = time.monotonic() + 180, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert proc.poll() is None, f"kiln serve exited: {(tmp_path / 'serve.log').read_text()[-2000:]}"
        assert status == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# ---- kiln cache ------------------------------------------------------------------------------
def _fill_cache(root: Path) -> None:
    (root / "models" / "smol-abc").mkdir(parents=True)
    (root / "models" / "smol-abc" / "model.safetensors").write_bytes(b"x" * 3000)
    (root / "compile" / "graph-123").mkdir(parents=True)
    (root / "compile" / "graph-123" / "piece0.so").write_bytes(b"y" * 10)
    (root / "unrelated").mkdir()


def test_cache_ls_and_clear(tmp_path, capsys):
    root = tmp_path / "cache"
    _fill_cache(root)
    assert cache_cmd.main(["ls", f"cache.dir={root}"]) == 0
    out = capsys.readouterr().out
    assert "models/smol-abc" in out and "2.9 KiB" in out and "compile/graph-123" in out
    assert "unrelated" not in out

    assert cache_cmd.main(["clear", "graph-123", f"cache.dir={root}"]) == 0
    assert not (root / "compile" / "graph-123").exists() and (root / "models" / "smol-abc").exists()
    assert cache_cmd.main(["clear", "nope", f"cache.dir={root}"]) == 1
    assert "not in the cache" in capsys.readouterr().err

    assert cache_cmd.main(["clear", f"cache.dir={root}"]) == 0
    assert not (root / "models" / "smol-abc").exists()
    assert (root / "unrelated").exists()  # only kiln's own kinds are ever removed
    assert cache_cmd.main(["dump", f"cache.dir={root}"]) == 2


def test_cache_command_line(tmp_path):
    root = tmp_path / "cache"
    _fill_cache(root)
    res = kiln("cache", "ls", f"cache.dir={root}", cwd=tmp_path)
    assert res.returncode == 0 and "models/smol-abc" in res.stdout
    assert kiln("cache", "ls", "cache.block_size=0", cwd=tmp_path).returncode == 2
