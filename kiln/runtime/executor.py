"""Executors: the boundary between the engine core and the model runner(s).

The engine talks to an ``Executor`` only, so the same engine drives one runner in this process
(``uni``) or one runner per rank in other processes: local processes (``mp``:
``kiln.runtime.mp_executor``) or Ray actors, on this host or across several (``ray``:
``kiln.runtime.ray_executor``, which needs the optional package ``ray``). An executor receives the
sub-configs it needs, never the whole EngineConfig.
"""

from __future__ import annotations

import abc

from typing import Optional

from kiln.config import CacheConfig, CompileConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kiln.runtime.model_runner import ModelRunner, RunnerOutput
from kiln.runtime.scheduler_output import SchedulerOutput


class Executor(abc.ABC):
    """Runs scheduled steps on the model; exposes what the engine needs to know of it."""

    num_blocks: int
    max_model_len: int
    tokenizer: object
    eos_token_id: int | None

    @abc.abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput: ...

    @abc.abstractmethod
    def forget(self, request_ids: list[str]) -> None:
        """Drop per-request state of finished requests."""

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    """One model runner in this process."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, compile: CompileConfig,
                 scheduler: Optional[SchedulerConfig] = None):
        self.runner = ModelRunner(model, cache, compile, scheduler)
        self.num_blocks = self.runner.num_blocks
        self.max_model_len = self.runner.max_model_len
        self.tokenizer = self.runner.tokenizer
        eos = self.runner.arch.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, (tuple, list)) and eos else eos
        self.vocab_size = self.runner.arch.vocab_size

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(sched)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.runner.forget(rid)


def make_executor(model: ModelConfig, cache: CacheConfig, compile: CompileConfig, parallel: ParallelConfig,
                  scheduler: Optional[SchedulerConfig] = None) -> Executor:
    if parallel.backend == "mp":
        from kiln.runtime.mp_executor import MultiprocExecutor  # imports this module: not at the top

        return MultiprocExecutor(model, cache, compile, parallel, scheduler)
    if parallel.backend == "ray":
        from kiln.runtime.ray_executor import make_ray_executor

        return make_ray_executor(model, cache, compile, parallel, scheduler)
    if parallel.tensor_parallel_size != 1:
        raise ValueError(
            f"parallel.backend=uni runs one process; tensor_parallel_size={parallel.tensor_parallel_size} "
            "needs parallel.backend=mp (or ray)"
        )
    return UniProcExecutor(model, cache, compile, scheduler)
