"""Executors: the boundary between the engine core and the model runner(s).

The engine talks to an ``Executor`` only, so the same engine drives one runner in this process
(``uni``) or one runner per rank in other processes (``mp``, ``ray``; they arrive with tensor
parallelism). An executor receives the sub-configs it needs, never the whole EngineConfig.
"""

from __future__ import annotations

import abc

from kiln.config import CacheConfig, CompileConfig, ModelConfig, ParallelConfig
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

    def __init__(self, model: ModelConfig, cache: CacheConfig, compile: CompileConfig):
        self.runner = ModelRunner(model, cache, compile)
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


def make_executor(model: ModelConfig, cache: CacheConfig, compile: CompileConfig, parallel: ParallelConfig) -> Executor:
    if parallel.tensor_parallel_size != 1 or parallel.backend != "uni":
        raise ValueError(
            f"parallel.backend={parallel.backend!r} with tensor_parallel_size={parallel.tensor_parallel_size} "
            "is not available yet; use parallel.backend=uni parallel.tensor_parallel_size=1"
        )
    return UniProcExecutor(model, cache, compile)
