"""The CLI's config: ``CliConfig`` (the engine's groups plus the commands' own keys), the Hydra
schema it registers, and composition without running a Hydra job. ``kiln.entrypoints.cli`` runs the
commands; ``kiln.entrypoints.cache_cmd`` composes with this too."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from kiln.bench.sweep import BenchConfig
from kiln.config import (
    CacheConfig, CompileConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig,
)

# The Hydra YAML is package data (kiln/configs/), so a wheel install finds it as a checkout does.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
SCHEMA_NAME = "kiln_schema"

@dataclass(frozen=True)
class CliConfig:
    """The composed config of every subcommand: the engine's groups plus the commands' own keys."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    prompt: str = "Tell me a joke."  # generate
    max_tokens: int = 64  # generate
    temperature: float = 0.0  # generate; 0 is greedy
    chat: bool = True  # generate: apply the chat template when the tokenizer has one


def engine_config(cli: CliConfig) -> EngineConfig:
    return EngineConfig(model=cli.model, cache=cli.cache, scheduler=cli.scheduler,
                        compile=cli.compile, server=cli.server, parallel=cli.parallel)


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore; call before composing (main and tests do)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name=SCHEMA_NAME, node=_writable(OmegaConf.structured(CliConfig)))


def _writable(node):
    # OmegaConf marks the node of a frozen dataclass read-only, which would refuse every override.
    # The YAML and overrides are merged into a writable copy; to_object then builds the frozen objects.
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_readonly(node, False)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
    return node


def compose_config(overrides: list[str]) -> CliConfig:
    """Compose without running a Hydra job (no output dir, no logging set-up): ``kiln cache``, tests."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return to_cli_config(compose(config_name="config", overrides=overrides))


def to_cli_config(cfg) -> CliConfig:
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"kiln: error: {message}", file=sys.stderr)
    sys.exit(code)
