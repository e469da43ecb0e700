"""The ``kiln`` command: ``kiln <serve|generate|bench|cache> [Hydra overrides]``.

    kiln serve model=smollm2-135m-instruct compile.mode=kiln server.port=8000
    kiln generate prompt="Tell me a joke" chat=false
    kiln bench -m compile.mode=eager,stock,kiln compile.cudagraph=none,piecewise,full
    kiln cache ls | inspect KEY | clear [KEY] | export PATH
    kiln serve --cfg job        # print the composed config;  kiln generate --help: groups and options
    kiln generate "prompt='Hello, world'"   # a value with a comma (a sweep list to Hydra) is quoted

Hydra stays at this edge: ``main`` registers the config dataclasses in Hydra's ConfigStore (the
``kiln_schema`` that ``kiln/configs/config.yaml`` extends), Hydra composes YAML and overrides, and
``OmegaConf.to_object`` turns the result into ``CliConfig``, whose dataclasses validate themselves.
Nothing below receives a DictConfig. A wrong value ends the command with one line naming the field
and the allowed values (exit code 2); ``HYDRA_FULL_ERROR=1`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Optional

from kiln.entrypoints.cli_config import (  # noqa: F401  (compose_config: the tests' import path)
    CONFIG_DIR, CliConfig, compose_config, engine_config, fail, register_configs, to_cli_config,
)

COMMANDS = {
    "serve": "run the OpenAI-compatible server",
    "generate": "generate a completion for `prompt` and print it",
    "bench": "benchmark compile modes (use -m to sweep; one process per combination)",
    "cache": "ls, inspect KEY, clear [KEY] or export PATH: converted models and compiled artifacts",
}


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _checked(cfg) -> CliConfig:
    from omegaconf.errors import OmegaConfBaseException

    try:
        return to_cli_config(cfg)
    except (ValueError, TypeError, OmegaConfBaseException) as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        fail(_first_line(exc))


def _user_errors(run: Callable[[], None]) -> None:
    # The engine refuses bad settings with a ValueError that says what to change: show just that.
    try:
        run()
    except ValueError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        fail(_first_line(exc), code=1)


# ---- commands (each gets a validated CliConfig) ------------------------------------------------
def cmd_serve(cli: CliConfig) -> None:
    try:
        from kiln.entrypoints.openai.api_server import run_server
    except ImportError as exc:
        fail(f"the OpenAI server is not available in this installation ({exc})", code=1)
    _user_errors(lambda: run_server(engine_config(cli)))


def cmd_generate(cli: CliConfig) -> None:
    from kiln.entrypoints.llm import LLM
    from kiln.sampling_params import SamplingParams

    def run() -> None:
        engine = engine_config(cli)
        llm = LLM(model=engine.model, cache=engine.cache, scheduler=engine.scheduler,
                  compile=engine.compile, parallel=engine.parallel)
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


# ---- entry point -------------------------------------------------------------------------------
def usage() -> str:
    groups = sorted(p for p in CONFIG_DIR.iterdir() if p.is_dir()) if CONFIG_DIR.is_dir() else []
    lines = ["usage: kiln <command> [group=option ...] [key=value ...] [Hydra flags: --cfg job, --help, -m]",
             "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
    lines += ["", f"config groups ({CONFIG_DIR}/<group>/<option>.yaml):"]
    lines += [f"  {g.name + ':':<11} {', '.join(sorted(p.stem for p in g.glob('*.yaml')))}" for g in groups]
    lines += ["", "`kiln <command> --help` shows every option and its default."]
    return "\n".join(lines)


def run_hydra(command: str, args: list[str]) -> None:
    """Hand ``args`` to a Hydra app running ``TASKS[command]``, so Hydra's own flags work."""
    import hydra

    if not (CONFIG_DIR / "config.yaml").is_file():
        fail(f"no configs found at {CONFIG_DIR}; this kiln installation lacks its package data", 1)
    register_configs()
    task = TASKS[command]

    @hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
    def app(cfg) -> None:
        task(_checked(cfg))

    sys.argv = [f"kiln {command}", *args]
    app()


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
