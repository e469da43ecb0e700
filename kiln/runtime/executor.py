"""Executors: the boundary between the engine core and the model runner(s).

The engine talks to an ``Executor`` only, so the same engine drives one runner in this process
(``uni``) or one runner per rank in other processes: local processes (``mp``:
``kiln.runtime.mp_executor``) or Ray actors, on this host or across several (``ray``:
``kiln.runtime.ray_executor``, which needs the optional package ``ray``). An executor receives the
sub-configs it needs, never the whole EngineConfig.

A step is ``handle = submit(sched)`` then ``wait(handle) -> RunnerOutput``; the engine does host
work in between (``kiln.runtime.engine``'s step pipeline). Rules every executor keeps:
- At most one step is in flight: ``submit`` again only after ``wait`` returned.
- Between ``submit`` and ``wait`` the engine may finish requests of the step in flight and
  ``forget`` them; a forget takes effect after that step, never inside it.
- ``wait`` raises the step's failure; a failed executor refuses every later ``submit``.
"""

from __future__ import annotations

import abc

from dataclasses import dataclass
from typing import Any, Optional, Union

from kiln.config import CacheConfig, CompileConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kiln.runtime.model_runner import LaunchedStep, ModelRunner, RunnerOutput
from kiln.runtime.scheduler_output import SchedulerOutput


class Executor(abc.ABC):
    """Runs scheduled steps on the model; exposes what the engine needs to know of it."""

    num_blocks: int
    max_model_len: int
    tokenizer: object
    eos_token_id: int | None

    @abc.abstractmethod
    def submit(self, sched: SchedulerOutput) -> Any:
        """Start a step; returns a handle for ``wait``. Never called with an empty schedule by the engine."""

    @abc.abstractmethod
    def wait(self, handle: Any) -> RunnerOutput:
        """The result of the step ``handle`` names, once it is done."""

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.wait(self.submit(sched))

    @abc.abstractmethod
    def forget(self, request_ids: list[str]) -> None:
        """Drop per-request state of finished requests."""

    def shutdown(self) -> None:
        pass

    def _describe_model(self, num_blocks: int, max_model_len: int, tokenizer: object, arch) -> None:
        """Record what the engine reads of the model (``arch``: rank 0's ArchConfig)."""
        self.num_blocks, self.max_model_len, self.tokenizer = num_blocks, max_model_len, tokenizer
        eos = arch.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, (tuple, list)) and eos else eos
        self.vocab_size = arch.vocab_size


@dataclass
class _Deferred:
    """A step submitted on the CPU: it runs in ``wait``."""

    sched: SchedulerOutput


class UniProcExecutor(Executor):
    """One model runner in this process.

    On a GPU ``submit`` launches the step (the kernels run while the engine works) and ``wait``
    reads the tokens back. On the CPU the runner computes synchronously, so a launch in ``submit``
    would finish the whole step before the engine could process the previous one, delaying every
    output by a step for nothing; there the step runs in ``wait``. Nothing the runner reads changes
    between the two calls (the engine's pipeline rule), so both orders give the same tokens.
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, compile: CompileConfig,
                 scheduler: Optional[SchedulerConfig] = None):
        self.runner = ModelRunner(model, cache, compile, scheduler)
        self._describe_model(self.runner.num_blocks, self.runner.max_model_len, self.runner.tokenizer,
                             self.runner.arch)
        self._launch_in_submit = self.runner.device.type == "cuda"
        self._in_flight = False
        self._forgets: list[str] = []  # forgotten while a step was in flight: applied after it

    def submit(self, sched: SchedulerOutput) -> Union[LaunchedStep, _Deferred]:
        if self._in_flight:
            raise RuntimeError("a step is already in flight: wait() for it before submitting another")
        handle = self.runner.launch(sched) if self._launch_in_submit else _Deferred(sched)
        self._in_flight = True
        return handle

    def wait(self, handle: Union[LaunchedStep, _Deferred]) -> RunnerOutput:
        try:
            launched = self.runner.launch(handle.sched) if isinstance(handle, _Deferred) else handle
            return self.runner.collect(launched)
        finally:
            self._in_flight = False
            forgets, self._forgets = self._forgets, []
            self.forget(forgets)

    def forget(self, request_ids: list[str]) -> None:
        if self._in_flight:  # e.g. a seeded generator the step still draws from (on the CPU, not yet)
            self._forgets.extend(request_ids)
            return
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
