"""The ``kiln`` command: Hydra composition, ``model=X``, overrides, clean errors, ``--help``, no run
directory for serve and generate, and each subcommand end to end."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kiln.config import EngineConfig, KernelConfig
from kiln.entrypoints import cache_cmd
from kiln.entrypoints.cli import CONFIG_DIR, CliConfig, engine_config, main, register_configs
from kiln.entrypoints.cli_config import CHOICES, FIELD_HELP, config_keys, prepare_overrides
from kiln.runtime.worker import free_port
from tests.helpers.paths import REPO


def composed(overrides: list[str]):
    """Compose as the CLI does: ``prepare_overrides`` first (``model=X``, unknown keys), then Hydra."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="config", overrides=prepare_overrides(overrides))


def exit_of(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run ``main(argv)`` in process: its exit code, stdout and stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


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
    assert (cli.compile.mode, cli.compile.cudagraph, cli.compile.capture_sizes) == ("auto", "auto", None)
    assert cli.scheduler.max_num_seqs is None  # sized for the device when the engine starts
    assert cli.bench.kind == "throughput" and cli.bench.batch_sizes == (1, 8, 32)
    assert cli.chat is True and cli.prompt
    engine = engine_config(cli)
    assert isinstance(engine, EngineConfig) and engine.compile is cli.compile


def test_groups_and_overrides():
    cfg = composed(["model_preset=tiny-random", "compile=kiln-piecewise", "server.port=9001", "bench=latency",
                    "compile.capture_sizes=[4,1,2]", "cache.block_size=32", "prompt=Hi there"])
    cli = OmegaConf.to_object(cfg)
    assert cli.model.model == "random:tiny"
    assert (cli.compile.mode, cli.compile.cudagraph) == ("kiln", "piecewise")
    assert cli.compile.capture_sizes == (1, 2, 4)  # the dataclass sorts and stores a tuple
    assert cli.server.port == 9001 and cli.cache.block_size == 32
    assert cli.bench.kind == "latency" and cli.prompt == "Hi there"


def test_lora_keys_reach_the_engine_config():
    cli = OmegaConf.to_object(composed(["lora.max_loras=2", "lora.max_lora_rank=16", "lora.max_cpu_loras=6",
                                        "server.lora_modules=[\"sql=/adapters/sql\"]"]))
    lora = engine_config(cli).lora
    assert (lora.enabled, lora.max_loras, lora.max_lora_rank, lora.num_cpu_loras) == (False, 2, 16, 6)
    assert engine_config(cli).resolved("cpu").lora.enabled  # an adapter served from the start turns it on
    with pytest.raises(ValueError, match="lora.max_cpu_loras=1 is below lora.max_loras=2"):
        OmegaConf.to_object(composed(["lora.max_loras=2", "lora.max_cpu_loras=1"]))
    # name=path items unquoted are a Hydra parse error; the message shows the quoted form
    with pytest.raises(ValueError, match=r"""'server.lora_modules=\["sql=/a","b=/c"\]'"""):
        prepare_overrides(["server.lora_modules=[sql=/a,b=/c]"])


def test_kernel_keys_reach_the_engine_config():
    cli = OmegaConf.to_object(composed(["kernels.pdl=off", "kernels.gemv_join=[dense,fp8]", "kernels.rope_join=false",
                                        "kernels.max_store_join_pairs=0", "kernels.fp8_decode_maxnreg=128"]))
    assert engine_config(cli).kernels == KernelConfig(pdl="off", gemv_join=("dense", "fp8"), rope_join=False,
                                                      max_store_join_pairs=0, fp8_decode_maxnreg=128)
    assert OmegaConf.to_object(composed(["kernels.gemv_join=[]"])).kernels.gemv_join == ()
    assert engine_config(OmegaConf.to_object(composed([]))).kernels == KernelConfig()


def test_a_bad_kernel_value_is_one_clear_line(capsys):
    code, _, err = exit_of(["serve", "kernels.pdl=maybe"], capsys)
    assert (code, err) == (2, "kiln: error: kernels.pdl='maybe' is not allowed; choose one of ['on', 'off', 'gemm']\n")
    code, _, err = exit_of(["serve", "kernels.gemv_join=[dense,int5]"], capsys)
    assert code == 2 and "kernels.gemv_join=['dense', 'int5']: 'int5' is not a scheme; choose from" in err
    code, _, err = exit_of(["serve", "kernels.rope_join=0"], capsys)
    assert (code, err) == (2, "kiln: error: kernels.rope_join takes true or false, got '0'\n")
    code, _, err = exit_of(["serve", "kernels.pdll=off"], capsys)
    assert code == 2 and "unknown key kernels.pdll; did you mean kernels.pdl?" in err


def test_every_option_of_every_group_composes(monkeypatch):
    monkeypatch.setenv("KILN_HF_DIR", "/some/hf/dir")
    groups = {p.name: sorted(q.stem for q in p.glob("*.yaml")) for p in CONFIG_DIR.iterdir() if p.is_dir()}
    assert set(groups) == {"model_preset", "compile", "cache", "scheduler", "server", "parallel", "speculative", "bench"}
    assert {"eager", "stock", "kiln", "kiln-piecewise", "kiln-full"} <= set(groups["compile"])
    assert {"throughput", "latency", "serve", "startup"} <= set(groups["bench"])
    for group, options in groups.items():
        for option in options:
            assert isinstance(OmegaConf.to_object(composed([f"{group}={option}"])), CliConfig), (group, option)
    assert OmegaConf.to_object(composed(["model_preset=hf-local"])).model.model == "/some/hf/dir"


# ---- model=X: a name, a directory, a .gguf file or random:<preset>; presets in model_preset/ -----
@pytest.mark.parametrize("model", ["random:tiny", "/some/hf/dir", "/models/SmolLM2.Q4_1.gguf",
                                   "smollm2-135m-instruct", "random:llama3-8b"])
def test_model_sets_model_model(model):
    cli = OmegaConf.to_object(composed([f"model={model}"]))
    assert cli.model.model == model
    assert cli.model.dtype == "auto"  # no preset picked: every other field keeps its default


def test_model_presets_and_model_fields():
    assert OmegaConf.to_object(composed([])).model.model == "smollm2-135m-instruct"  # the embedded default
    preset = OmegaConf.to_object(composed(["model_preset=llama3-8b-random"])).model
    assert (preset.model, preset.dtype) == ("random:llama3-8b", "bfloat16")
    # a preset's name after model= picks the preset (the old spelling, kept working)
    assert OmegaConf.to_object(composed(["model=llama3-8b-random"])).model == preset
    # a model and other fields on top of a preset; the command line wins
    cli = OmegaConf.to_object(composed(["model_preset=llama3-8b-random", "model=random:tiny",
                                        "model.dtype=float16", "model.max_model_len=256"]))
    assert (cli.model.model, cli.model.dtype, cli.model.max_model_len) == ("random:tiny", "float16", 256)
    assert prepare_overrides(["model=random:tiny,random:tiny-qwen2"]) == ["model.model=random:tiny,random:tiny-qwen2"]
    with pytest.raises(ValueError, match="mixes presets and models"):
        prepare_overrides(["model=tiny-random,random:tiny"])


def test_bad_value_names_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"compile\.mode='fast'.*\['auto', 'eager', 'stock', 'kiln'\]"):
        OmegaConf.to_object(composed(["compile.mode=fast"]))
    with pytest.raises(ValueError, match=r"bench\.kind"):
        OmegaConf.to_object(composed(["bench.kind=soak"]))


def test_unknown_key_and_wrong_type_refused_at_composition():
    with pytest.raises(ValueError, match="unknown key compile.bogus"):
        composed(["compile.bogus=1"])
    with pytest.raises(ValueError, match="^server.port takes a whole number, got 'eighty'$"):
        composed(["server.port=eighty"])


@pytest.mark.parametrize("override, says", [
    ("server.port=abc", "server.port takes a whole number, got 'abc'"),
    ("temperature=hot", "temperature takes a number, got 'hot'"),
    ("max_tokens=1.5", "max_tokens takes a whole number, got '1.5'"),
    ("chat=maybe", "chat takes true or false, got 'maybe'"),
    ("compile.split_every=x", "compile.split_every takes a whole number or null, got 'x'"),
    ("server.port=null", "server.port takes a whole number, got 'null'"),
])
def test_a_value_of_the_wrong_type_is_one_line_in_kilns_words(capsys, override, says):
    code, out, err = exit_of(["generate", override], capsys)
    assert (code, out, err) == (2, "", f"kiln: error: {says}\n")
    assert "HYDRA_FULL_ERROR" not in err


def test_values_of_the_right_type_pass_the_check():
    cli = OmegaConf.to_object(composed(["server.port=9000", "temperature=1", "chat=false",
                                        "compile.split_every=null", "model.model=123"]))
    assert (cli.server.port, cli.temperature, cli.chat, cli.compile.split_every, cli.model.model) == (
        9000, 1.0, False, None, "123")


def test_typo_names_the_closest_key_and_exits_2(capsys):
    code, out, err = exit_of(["serve", "compile.mod=kiln"], capsys)
    assert code == 2 and not out
    assert err == "kiln: error: unknown key compile.mod; did you mean compile.mode?\n"
    assert "+compile.mod" not in err  # never Hydra's advice to add a key nothing reads
    assert exit_of(["generate", "+compile.mod=kiln"], capsys)[2].endswith("did you mean compile.mode?\n")
    assert exit_of(["generate", "max_token=3"], capsys)[2].endswith("did you mean max_tokens?\n")
    assert exit_of(["serve", "zzz=1"], capsys)[2] == (
        "kiln: error: unknown key zzz; `kiln <command> --help` lists every key\n")


def test_the_replaced_startup_keys_exit_2_naming_compile_startup(capsys):
    for key in ("compile.build=background", "compile.capture=lazy", "compile.max_startup_capture_size=8"):
        code, out, err = exit_of(["serve", key], capsys)
        assert code == 2 and not out
        assert err.startswith(f"kiln: error: {key.split('=')[0]} is gone: set compile.startup"), err
    assert OmegaConf.to_object(composed(["compile.startup=fast"])).compile.startup == "fast"
    with pytest.raises(ValueError, match="compile.startup"):
        OmegaConf.to_object(composed(["compile.startup=later"]))


def test_serve_on_a_port_in_use_fails_before_loading_the_model(capsys, monkeypatch):
    """A port another process holds is refused at once with what to change (exit 1), before the
    engine (the model's start-up) is built; the port is free again afterwards."""
    import socket

    from kiln.engine import launch
    from kiln.entrypoints.openai import api_server

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was started before the port was checked")

    monkeypatch.setattr(api_server, "EngineCoreClient", no_engine)
    monkeypatch.setattr(launch.EngineCoreProcess, "__init__", no_engine)  # what `kiln serve` spawns first
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, out, err = exit_of(["serve", "model=random:tiny", f"server.port={port}"], capsys)
    assert code == 1 and not out
    starting, error = err.splitlines()  # the line said before the imports, then the refusal
    assert "kiln: starting the server for random:tiny" in starting
    assert error == (f"kiln: error: cannot listen on 127.0.0.1:{port}: Address already in use; another process "
                     "listens there: stop it or choose another server.port")
    code, _, err = exit_of(["serve", "model=random:tiny", "server.host=no-such-host.invalid"], capsys)
    starting, error = err.splitlines()
    assert code == 1 and error.startswith("kiln: error: cannot listen on no-such-host.invalid:8000: ")
    assert error.endswith("; choose another server.host or server.port")
    api_server.bind_socket("127.0.0.1", port).close()  # nothing of kiln's holds it


def test_serve_with_a_model_that_does_not_load_says_why_in_one_line(capsys):
    """The engine is built in its own process: the ValueError of a bad model reaches the command
    line as that error (exit 1), not as a dead engine's traceback."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for model, says in (("/nonexistent/dir", "model='/nonexistent/dir' is neither a registered model"),
                        ("random:nope", "random:")):
        code, out, err = exit_of(["serve", f"model={model}", f"server.port={port}"], capsys)
        last = err.strip().splitlines()[-1]
        assert code == 1 and not out and last.startswith("kiln: error: ") and says in last, err
        assert "Traceback" not in err and "engine" not in last, err


def test_unknown_group_option_names_the_closest_option(capsys):
    code, _, err = exit_of(["serve", "compile=kiln-piecwise"], capsys)
    assert (code, err) == (2, "kiln: error: unknown compile option kiln-piecwise; did you mean kiln-piecewise?\n")
    code, _, err = exit_of(["bench", "-m", "bench=latency,soak"], capsys)
    assert code == 2 and "unknown bench option soak; choose one of latency, serve, startup, throughput" in err
    code, _, err = exit_of(["generate", "model_preset=tiny-randm"], capsys)
    assert code == 2 and err.endswith("did you mean tiny-random?\n")


# ---- --help: every key a command reads, its value, its choices, what it does ---------------------
def test_every_key_has_help_and_choices_match_the_dataclasses():
    keys = {k for section in config_keys().values() for k in section}
    assert set(FIELD_HELP) == keys and all(FIELD_HELP.values())
    cli = CliConfig()
    for key in sorted(keys):
        section, _, name = key.rpartition(".")
        sub = getattr(cli, section) if section else None
        if sub is None or not isinstance(getattr(sub, name), str):
            assert key not in CHOICES, key
            continue
        if key in CHOICES:
            for choice in CHOICES[key]:
                dataclasses.replace(sub, **{name: choice})  # each listed value is accepted
            with pytest.raises(ValueError, match=re.escape(str(list(CHOICES[key])))):
                dataclasses.replace(sub, **{name: "no-such-value"})
        else:  # a field the dataclass checks against a list must list it in CHOICES
            try:
                dataclasses.replace(sub, **{name: "no-such-value"})
            except ValueError as exc:
                assert "choose one of" not in str(exc), key


def test_serve_help_lists_its_groups_only(capsys):
    code, out, _ = exit_of(["serve", "--help"], capsys)
    assert code == 0
    assert "compile.mode=auto  (auto | eager | stock | kiln)" in out
    assert "compile.cudagraph=auto  (auto | none | piecewise | full | full_and_piecewise)" in out
    assert FIELD_HELP["compile.mode"] in out and "server.port=8000" in out
    assert "model  (model_preset=hf-local | llama3-8b-random" in out
    assert "bench." not in out and "  prompt=" not in out  # generate's key, not server.limit_mm_per_prompt
    # values are what the command line composes to
    out = exit_of(["serve", "--help", "compile=kiln-full", "model=random:tiny"], capsys)[1]
    assert "compile.mode=kiln " in out and "compile.cudagraph=full " in out and "model.model=random:tiny\n" in out


def test_serve_help_lists_the_kernel_keys(capsys):
    code, out, _ = exit_of(["serve", "--help"], capsys)
    assert code == 0
    assert "\nkernels\n" in out
    assert "kernels.pdl=on  (on | off | gemm)" in out and "kernels.decode_merge=fused  (fused | kernel)" in out
    for key in ("kernels.gemv_join=[dense]", "kernels.dense_gemv=true", "kernels.max_store_join_pairs=256",
                "kernels.fp8_decode_maxnreg=null", "kernels.rope_join=true", "kernels.lora_join=true"):
        assert key in out, key
    assert FIELD_HELP["kernels.max_store_join_pairs"] in out and "to measure" in FIELD_HELP["kernels.decode_merge"]
    out = exit_of(["serve", "--help", "kernels.pdl=gemm"], capsys)[1]
    assert "kernels.pdl=gemm  (on | off | gemm)" in out


def test_generate_and_bench_help(capsys):
    code, out, _ = exit_of(["generate", "--help"], capsys)
    assert code == 0
    assert 'prompt="Give me three tips for a good night\'s sleep."' in out and "max_tokens=64" in out and "compile.mode=auto" in out
    assert "server." not in out and "bench." not in out
    code, out, _ = exit_of(["bench", "-h"], capsys)
    assert code == 0
    assert "bench.kind=throughput  (throughput | latency | serve | startup)" in out
    assert all(f"\n{s}  (" in out for s in ("model", "cache", "scheduler", "compile", "server", "parallel", "bench"))


# ---- the command line (subprocess) -----------------------------------------------------------
def test_cfg_job_prints_composed_config(tmp_path):
    res = kiln("serve", "--cfg", "job", "model=random:tiny", "compile.mode=kiln", "server.port=8123", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    printed = yaml.safe_load(res.stdout)
    assert printed["model"]["model"] == "random:tiny"
    assert printed["compile"]["mode"] == "kiln" and printed["server"]["port"] == 8123
    assert not (tmp_path / "outputs").exists()


def test_wrong_override_fails_with_one_clear_line(tmp_path):
    res = kiln("generate", "compile.mode=fast", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert res.returncode == 2
    assert "compile.mode='fast'" in res.stderr and "['auto', 'eager', 'stock', 'kiln']" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_help_lists_commands_groups_and_options(tmp_path):
    top = kiln("--help", cwd=tmp_path)
    assert top.returncode == 0
    assert all(c in top.stdout for c in ("serve", "generate", "bench", "cache", "compile:", "kiln-piecewise"))
    assert "model_preset: hf-local, llama3-8b-random" in top.stdout and "random:<preset>" in top.stdout
    sub = kiln("generate", "--help", cwd=tmp_path)
    assert sub.returncode == 0 and "max_tokens=64" in sub.stdout
    assert kiln("fly", cwd=tmp_path).returncode == 2
    assert not (tmp_path / "outputs").exists()


def test_only_bench_gets_a_run_directory(tmp_path):
    for command in ("serve", "generate"):
        res = kiln(command, "--cfg", "hydra", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        hydra_cfg = yaml.safe_load(res.stdout)["hydra"]
        assert hydra_cfg["run"]["dir"] == "." and hydra_cfg["output_subdir"] is None
        assert "file" not in hydra_cfg["job_logging"]["handlers"]  # no kiln.log either
    bench = yaml.safe_load(kiln("bench", "--cfg", "hydra", cwd=tmp_path).stdout)["hydra"]
    assert bench["run"]["dir"].startswith("outputs/kiln/") and bench["output_subdir"] == ".hydra"


def test_console_script_is_installed(tmp_path):
    script = Path(sys.executable).parent / "kiln"
    if not script.exists():
        pytest.skip("kiln is not installed in this environment (pip install -e .)")
    res = subprocess.run([str(script), "generate", "--cfg", "job", "model=random:tiny"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout)["model"]["model"] == "random:tiny"


def test_generate_prints_text_and_leaves_no_files(tmp_path):
    res = kiln("generate", "model=random:tiny", "prompt=Tell me a joke", "max_tokens=6", "chat=false",
               cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip(), "generate printed no text"
    assert "[INFO]" not in res.stdout and "[INFO]" in res.stderr  # logs go to stderr; stdout is the text only
    assert list(tmp_path.iterdir()) == []  # no outputs/, .hydra/ or kiln.log in the current directory


@pytest.mark.skipif(importlib.util.find_spec("kiln.entrypoints.openai.api_server") is None,
                    reason="the OpenAI server (kiln.entrypoints.openai) is not in this tree yet")
def test_serve_answers_health(tmp_path):
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.entrypoints.cli", "serve", "model=random:tiny", f"server.port={port}"],
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
        assert sorted(p.name for p in tmp_path.iterdir()) == ["serve.log"]  # no outputs/ or kiln.log
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


def test_cache_ls_imports_neither_torch_nor_transformers(tmp_path):
    """`kiln cache ls` only reads metadata; importing torch would cost it seconds."""
    from kiln.compiler.artifact_cache import FACTORS

    assert cache_cmd.FACTORS_FILE == FACTORS
    root = tmp_path / "cache"
    _fill_cache(root)
    (root / "compile" / "graph-123" / FACTORS).write_text(json.dumps({"model": {"name": "random:tiny"}}))
    code = ("import json, sys\n"
            "from kiln.entrypoints.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print(json.dumps({'exit': code, 'imported': [m for m in ('torch', 'transformers') if m in sys.modules]}))")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code, "cache", "ls", f"cache.dir={root}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert "compile/graph-123" in res.stdout and "random:tiny" in res.stdout, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == {"exit": 0, "imported": []}
