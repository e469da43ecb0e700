"""The executor contract, and the failure rules every multi-rank executor keeps.

An ``Executor`` is the boundary between the engine core and the model runner(s): the engine talks
to it only, so the same engine drives one runner in this process (``uniproc``) or one runner per
tensor-parallel rank elsewhere (``mp``: local processes; ``ray``: Ray actors). An executor receives
the sub-configs it needs, never the whole EngineConfig.

A step is ``handle = submit(sched)`` then ``wait(handle) -> RunnerOutput``; the engine does host
work in between (``kiln.runtime.engine``'s step pipeline). Rules every executor keeps:
- At most one step is in flight: ``submit`` again only after ``wait`` returned.
- Between ``submit`` and ``wait`` the engine may finish requests of the step in flight and
  ``forget`` them; a forget takes effect after that step, never inside it.
- ``wait`` raises the step's failure.

Rules the multi-rank executors keep, written once here (``RankFailures``, ``raise_rank_failure``):
- Never a silent hang: start-up waits at most ``START_TIMEOUT_S`` (weights and compilation
  included), a step at most ``parallel.step_timeout_s``; a rank's collectives time out no sooner
  (``collective_timeout_s``), so it is the executor that reports a silent rank, by number.
- Fail fast: a rank that dies, errs or stays silent past its deadline fails the step with a
  RuntimeError naming the rank; a rank's own configuration error (ValueError or TypeError, e.g.
  on start-up) is re-raised as is. Every rank is stopped at once (survivors may be blocked in a
  collective with the dead rank), and the failed executor refuses every later ``submit`` and
  ``forget`` ("has failed").
"""

from __future__ import annotations

import abc

from typing import Any, Callable, NoReturn, Optional

from kiln.config import ParallelConfig
from kiln.models.parallel import TensorParallel
from kiln.models.pipeline import PipelineStage
from kiln.runtime.model_runner import RunnerOutput
from kiln.runtime.scheduler_output import SchedulerOutput

START_TIMEOUT_S = 900.0  # start-up includes weight loading and compilation


class Executor(abc.ABC):
    """Runs scheduled steps on the model; exposes what the engine needs to know of it."""

    num_blocks: int
    max_model_len: int
    tokenizer: object
    eos_token_ids: tuple[int, ...]  # every id that stops a request (none with ignore_eos)

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

    @property
    def has_pending_captures(self) -> bool:
        """CUDA-graph sizes left for ``capture_pending`` (lazy capture (``compile.startup`` auto or fast))."""
        return False

    @property
    def has_wanted_captures(self) -> bool:
        """Whether a pending size is one a batch ran without (it is captured at the next step boundary)."""
        return False

    def capture_pending(self) -> bool:
        """Capture one pending CUDA-graph size; only with no step in flight. Returns whether more are pending."""
        return False

    def _check_idle(self, in_flight: bool) -> None:
        """The one-step-in-flight rule, checked by ``submit``."""
        if in_flight:
            raise RuntimeError("a step is already in flight: wait() for it before submitting another")

    def _describe_model(self, num_blocks: int, max_model_len: int, tokenizer: object, arch) -> None:
        """Record what the engine reads of the model (``arch``: rank 0's ArchConfig)."""
        self.num_blocks, self.max_model_len, self.tokenizer = num_blocks, max_model_len, tokenizer
        eos = arch.eos_token_id
        self.eos_token_ids = tuple(eos) if isinstance(eos, (tuple, list)) else () if eos is None else (eos,)
        self.vocab_size = arch.vocab_size

    def _describe_ranks(self, infos: list[dict[str, Any]]) -> None:
        """The same from every rank's ``RankWorker.ready_info``, in rank order: the fewest KV blocks
        any rank holds, the rest from rank 0."""
        head = infos[0]
        self._describe_model(min(info["num_blocks"] for info in infos), head["max_model_len"], head["tokenizer"],
                             head["arch"])


def rank_layout(parallel: ParallelConfig) -> list[tuple[TensorParallel, PipelineStage]]:
    """Each global rank's tensor-parallel place and pipeline stage, in rank order (tp fastest, as
    vLLM lays them: ``kiln.models.pipeline``)."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    experts = parallel.enable_expert_parallel
    return [(TensorParallel(rank % tp, tp, experts), PipelineStage(rank // tp, pp)) for rank in range(tp * pp)]


def check_ranks_fit(parallel: ParallelConfig, num_gpus: int) -> None:
    """One GPU per rank on this host: say which keys to lower when there are fewer."""
    if parallel.world_size > num_gpus:
        raise ValueError(f"parallel.tensor_parallel_size={parallel.tensor_parallel_size} x "
                         f"parallel.pipeline_parallel_size={parallel.pipeline_parallel_size} needs "
                         f"{parallel.world_size} GPUs, one per rank; this machine has {num_gpus}: lower them")


def collective_timeout_s(step_timeout_s: float, start_timeout_s: float) -> float:
    """How long a rank's collectives may block: at least as long as the executor waits for it."""
    return max(step_timeout_s, start_timeout_s)


class RankFailures:
    """A multi-rank executor's failure state: the first failure is recorded, every rank stopped
    (``stop``: at once, safe to call again and before every rank started) and the failure raised;
    from then on ``check_usable`` raises "has failed"."""

    def __init__(self, executor_name: str, stop: Callable[[], None]):
        self.executor_name = executor_name  # as the "has failed" message names it
        self.reason: Optional[str] = None
        self._stop = stop

    def check_usable(self) -> None:
        if self.reason is not None:
            raise RuntimeError(f"the {self.executor_name} executor has failed and is shut down: {self.reason}")

    def fail(self, reason: str, exc: Optional[BaseException] = None) -> NoReturn:
        self.reason = reason
        self._stop()
        raise_rank_failure(reason, exc)

    def no_answer(self, ranks: list[int], timeout_s: float) -> NoReturn:
        """The deadline passed with ``ranks`` still silent."""
        self.fail(f"tensor-parallel rank(s) {ranks} gave no answer within {timeout_s:.0f} s "
                  f"(hung or deadlocked in a collective)")


def raise_rank_failure(reason: str, exc: Optional[BaseException] = None) -> NoReturn:
    """How an executor surfaces a failed rank: a rank's configuration error (ValueError or
    TypeError, e.g. heads that do not divide) keeps its type for the user; anything else is a
    RuntimeError that says which rank failed and how."""
    if isinstance(exc, (ValueError, TypeError)):
        raise exc from RuntimeError(reason)
    raise RuntimeError(reason) from exc
