"""The ``kiln`` command: ``kiln <serve|generate|bench|cache> [Hydra overrides]``.

    kiln serve model=smollm2-135m-instruct compile.mode=kiln server.port=8000
    kiln generate model=random:tiny prompt="What is the capital of France?" chat=false
    kiln serve model=/path/to/hf-dir          # or model=/path/file.gguf, model_preset=tiny-random
    kiln bench -m compile.mode=eager,stock,kiln compile.cudagraph=none,piecewise,full
    kiln cache ls | inspect KEY | clear [KEY] | export PATH
    kiln serve --cfg job        # print the composed config;  kiln serve --help: every key it uses
    kiln generate "prompt='Hello, world'"   # a value with a comma (a sweep list to Hydra) is quoted

Hydra stays at this edge: ``main`` registers the config dataclasses in Hydra's ConfigStore (the
``kiln_schema`` that ``kiln/configs/config.yaml`` extends), Hydra composes YAML and overrides, and
``OmegaConf.to_object`` turns the result into ``CliConfig``, whose dataclasses validate themselves.
Nothing below receives a DictConfig. Before Hydra sees them, ``prepare_overrides`` turns ``model=X``
into ``model.model=X`` and refuses an unknown key naming the closest one. A wrong key or value ends
the command with one line (exit code 2); ``HYDRA_FULL_ERROR=1`` shows the traceback instead.
Only ``kiln bench`` gets a Hydra run directory (it writes its records there); ``serve`` and
``generate`` run with ``NO_RUN_DIR`` and leave nothing in the current directory. A secret given as
an override (``server.api_key=...``) moves to $KILN_API_KEY before Hydra sees it: every config
Hydra saves or prints, and every bench record, shows ``***``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from kiln.entrypoints.cli_config import (  # noqa: F401  (compose_config: the tests' import path)
    CHOICES, CONFIG_DIR, FIELD_HELP, PRESET_GROUP, CliConfig, compose_config, config_keys, engine_config,
    extract_secrets, fail, group_options, prepare_overrides, register_configs, to_cli_config,
)
from kiln.errors import first_line

logger = logging.getLogger(__name__)

COMMANDS = {
    "serve": "run the OpenAI-compatible server",
    "generate": "generate a completion for `prompt` and print it",
    "bench": "benchmark compile modes (use -m to sweep; one process per combination)",
    "cache": "ls, inspect KEY, clear [KEY] or export PATH: converted models and compiled artifacts",
}


def _checked(cfg) -> CliConfig:
    from omegaconf.errors import OmegaConfBaseException

    try:
        return to_cli_config(cfg)
    except (ValueError, TypeError, OmegaConfBaseException) as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        fail(first_line(exc))


def _user_errors(run: Callable[[], None]) -> None:
    # The engine refuses bad settings with a ValueError that says what to change: show just that.
    try:
        run()
    except ValueError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        fail(first_line(exc), code=1)


# ---- commands (each gets a validated CliConfig) ------------------------------------------------
def cmd_serve(cli: CliConfig) -> None:
    # Importing torch and the server takes seconds before the engine's first line: say so at once.
    logger.info("kiln: starting the server for %s on %s:%s (importing torch, then loading the model)",
                cli.model.model, cli.server.host, cli.server.port)

    def run() -> None:
        from kiln.engine.launch import EngineCoreProcess
        from kiln.entrypoints.listen import bind_socket

        config = engine_config(cli)
        sock = bind_socket(config.server.host, config.server.port)  # a bad port fails before anything starts
        # The engine core imports torch and loads the model while this process imports the server.
        core = EngineCoreProcess.for_server(config)
        try:
            from kiln.entrypoints.openai.api_server import run_server
        except ImportError as exc:
            sock.close()
            if core is not None:
                core.stop(timeout=0)
            fail(f"the OpenAI server is not available in this installation ({exc})", code=1)
        run_server(config, engine_core=core, sock=sock)

    _user_errors(run)


def cmd_generate(cli: CliConfig) -> None:
    from kiln.entrypoints.llm import LLM
    from kiln.runtime.engine import engine_device_type
    from kiln.sampling_params import SamplingParams

    def run() -> None:
        engine = engine_config(cli)
        if engine.compile.mode == "auto" and engine_device_type(engine) == "cpu":
            # One prompt, then exit: on the CPU a background build would only compete with it.
            engine = dataclasses.replace(engine, compile=dataclasses.replace(engine.compile, mode="eager"))
        llm = LLM(model=engine.model, cache=engine.cache, scheduler=engine.scheduler,
                  compile=engine.compile, parallel=engine.parallel, speculative=engine.speculative,
                  kernels=engine.kernels)
        params = SamplingParams(max_tokens=cli.max_tokens, temperature=cli.temperature)
        if cli.chat and getattr(llm.tokenizer, "chat_template", None):
            outs = llm.chat([{"role": "user", "content": cli.prompt}], params, use_tqdm=False)
        else:
            outs = llm.generate(cli.prompt, params, use_tqdm=False)
        print(outs[0].outputs[0].text, flush=True)

    _user_errors(run)


def cmd_bench(cli: CliConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from kiln.bench.sweep import JobPaths, run_job

    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    # Not hydra_cfg.sweep.dir: its ${now:...} would be re-evaluated now. kiln/configs/config.yaml makes
    # each job's directory one level below the sweep's (subdir: the job number).
    report_dir = job_dir.parent if multirun else job_dir
    record = run_job(engine_config(cli), cli.bench, JobPaths(job_dir=job_dir, report_dir=report_dir))
    print(f"[bench] report: {report_dir}", flush=True)
    if not multirun and record["status"] == "error":
        sys.exit(1)  # a sweep goes on past a failed combination; a single run says it failed


TASKS = {"serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench}
# The sections of CliConfig each command reads ("": the top-level keys, generate's own).
COMMAND_SECTIONS = {
    "serve": ("model", "cache", "scheduler", "compile", "server", "parallel", "speculative", "lora", "kernels"),
    "generate": ("model", "cache", "scheduler", "compile", "parallel", "speculative", "kernels", ""),
    "bench": ("model", "cache", "scheduler", "compile", "server", "parallel", "speculative", "lora", "kernels",
              "bench"),
}
# serve and generate write nothing to a run directory: no outputs/, no .hydra/, no log file.
# They go before the user's overrides, so an explicit hydra.run.dir=... still wins.
NO_RUN_DIR = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout")


# ---- entry point -------------------------------------------------------------------------------
def usage() -> str:
    groups = sorted(p for p in CONFIG_DIR.iterdir() if p.is_dir()) if CONFIG_DIR.is_dir() else []
    lines = ["usage: kiln <command> [model=X] [group=option ...] [key=value ...] [Hydra flags: --cfg job, --help, -m]",
             "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
    lines += ["", "model=X: a registered name (smollm2-135m-instruct), a Hugging Face directory, a .gguf file "
              "or random:<preset> (random:tiny)"]
    lines += ["", f"config groups ({CONFIG_DIR}/<group>/<option>.yaml):"]
    lines += [f"  {g.name + ':':<13} {', '.join(group_options(g.name))}" for g in groups]
    lines += ["", "`kiln <command> --help` shows every key the command uses, its value and what it allows."]
    return "\n".join(lines)


def command_help(command: str, cli: CliConfig) -> str:
    """Every key ``command`` reads, by section: its value in ``cli``, its allowed values, what it does."""
    keys = config_keys()
    lines = [f"usage: kiln {command} [model=NAME|DIR|FILE.gguf|random:PRESET] [group=option ...] [key=value ...]"
             " [--cfg job]", "", COMMANDS[command], "",
             f"model=X sets model.model; X may also name a preset: model=tiny-random is {PRESET_GROUP}=tiny-random.",
             "group=option picks kiln/configs/<group>/<option>.yaml; key=value sets one key.",
             "Values shown are what this command line composes to."]
    for section in COMMAND_SECTIONS[command]:
        group = PRESET_GROUP if section == "model" else section
        options = group_options(group) if group else []
        lines += ["", (section or command) + (f"  ({group}={' | '.join(options)})" if options else "")]
        for key in keys[section]:
            choices = f"  ({' | '.join(CHOICES[key])})" if key in CHOICES else ""
            lines += [f"  {key}={_format_value(functools.reduce(getattr, key.split('.'), cli))}{choices}",
                      f"      {FIELD_HELP[key]}"]
    return "\n".join(lines)


def _format_value(value: Any) -> str:
    """``value`` as an override would write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    text = str(value)
    if text and not any(c in text for c in " ,'\"="):
        return text
    if "'" in text and '"' not in text:
        return f'"{text}"'
    return "'" + text.replace("'", "\\'") + "'"  # Hydra's escape inside single quotes


def _prepared(overrides: list[str]) -> list[str]:
    """``prepare_overrides``, then secrets out of the overrides and into this process's environment
    (which the server and bench workers read)."""
    from hydra.errors import HydraException

    try:
        overrides, secrets = extract_secrets(prepare_overrides(overrides))
        os.environ.update(secrets)
        return overrides
    except (ValueError, HydraException) as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        fail(first_line(exc))


def run_hydra(command: str, args: list[str]) -> None:
    """Hand ``args`` to a Hydra app running ``TASKS[command]``, so Hydra's own flags work; print
    kiln's own ``--help``."""
    import hydra
    from hydra._internal.utils import get_args_parser

    if not (CONFIG_DIR / "config.yaml").is_file():
        fail(f"no configs found at {CONFIG_DIR}; this kiln installation lacks its package data", 1)
    parsed = get_args_parser().parse_args(args)  # Hydra's own flags apart from the overrides
    flags = [a for a in args if a not in parsed.overrides]
    overrides = _prepared(parsed.overrides)
    if parsed.help:
        print(command_help(command, _composed(overrides)))
        sys.exit(0)
    register_configs()
    task = TASKS[command]

    @hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
    def app(cfg) -> None:
        task(_checked(cfg))

    run_dir = () if command == "bench" else NO_RUN_DIR
    sys.argv = [f"kiln {command}", *flags, *run_dir, *overrides]
    app()


def _composed(overrides: list[str]) -> CliConfig:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose_config(overrides)
    except (ValueError, TypeError, HydraException, OmegaConfBaseException) as exc:
        fail(first_line(exc))


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if argv else 2)
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        fail(f"unknown command {command!r}; choose one of {list(COMMANDS)}")
    if command == "cache":
        from kiln.entrypoints.cache_cmd import main as cache_main

        sys.exit(cache_main(args))
    run_hydra(command, args)


if __name__ == "__main__":
    main()
