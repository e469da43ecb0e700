"""UniProcExecutor: one model runner in this process (``parallel.backend=uni``).

On a GPU ``submit`` launches the step (the kernels run while the engine works) and ``wait`` reads
the tokens back. On the CPU the runner computes synchronously, so a launch in ``submit`` would
finish the whole step before the engine could process the previous one, delaying every output by
a step for nothing; there the step runs in ``wait``. Nothing the runner reads changes between the
two calls (the engine's pipeline rule), so both orders give the same tokens.

Rules kept here: a ``forget`` made while a step is in flight (e.g. of a seeded generator the step
still draws from) is held back and applied after that step's ``wait``. On a GPU a step may be
submitted ``after`` the one in flight (the engine's scheduling ahead): its decodes whose input token
is still a placeholder take it from that step's sampled tokens on the device; two steps are then
in flight, and they are waited for in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from kiln.config import (CacheConfig, CompileConfig, KernelConfig, LoraConfig, ModelConfig, SchedulerConfig,
                         SpeculativeConfig)
from kiln.lora_request import LoRARequest
from kiln.runtime.executor.base import Executor
from kiln.runtime.model_runner import LaunchedStep, RunnerOutput
from kiln.runtime.scheduler_output import SchedulerOutput


@dataclass
class _Deferred:
    """A step submitted on the CPU: it runs in ``wait``."""

    sched: SchedulerOutput


class UniProcExecutor(Executor):
    """One ``ModelRunner`` in this process."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, compile: CompileConfig,
                 scheduler: Optional[SchedulerConfig] = None, speculative: SpeculativeConfig = SpeculativeConfig(),
                 lora: LoraConfig = LoraConfig(), kernels: KernelConfig = KernelConfig()):
        from kiln.ops.options import set_kernel_options
        from kiln.runtime.model_runner import ModelRunner

        set_kernel_options(kernels)  # this process's kernels: the runner's, and any other engine's here
        self.runner = ModelRunner(model, cache, compile, scheduler, speculative=speculative, lora=lora)
        self._describe_model(self.runner.num_blocks, self.runner.max_model_len, self.runner.tokenizer,
                             self.runner.arch)
        self._launch_in_submit = self.runner.device.type == "cuda"
        self.can_schedule_ahead = self._launch_in_submit
        self._in_flight = 0  # steps submitted and not yet waited for
        self._forgets: list[str] = []  # forgotten while a step was in flight: applied after it

    def submit(self, sched: SchedulerOutput, after: Optional[LaunchedStep] = None) -> Union[LaunchedStep, _Deferred]:
        """``after``: the step in flight, whose tokens this step's placeholders take (GPU only)."""
        if after is None or not self.can_schedule_ahead:
            self._check_idle(self._in_flight > 0)
        elif self._in_flight > 1:
            raise RuntimeError("two steps are already in flight: wait() for one before submitting another")
        handle = self.runner.launch(sched, after) if self._launch_in_submit else _Deferred(sched)
        self._in_flight += 1
        return handle

    def wait(self, handle: Union[LaunchedStep, _Deferred]) -> RunnerOutput:
        try:
            launched = self.runner.launch(handle.sched) if isinstance(handle, _Deferred) else handle
            return self.runner.collect(launched)
        finally:
            self._in_flight = max(0, self._in_flight - 1)
            forgets, self._forgets = self._forgets, []
            self._forget_now(forgets)

    def shutdown(self) -> None:
        self.runner.shutdown()

    def add_lora(self, lora: LoRARequest) -> bool:
        """Read and check an adapter onto the runner's host cache (ValueError when refused)."""
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but this engine serves none; "
                             "start it with lora={...} (lora.enabled=true)")
        return self.runner.lora.add(lora)

    def remove_lora(self, lora_id: int) -> bool:
        return self.runner.lora is not None and self.runner.lora.remove(lora_id)

    @property
    def has_pending_captures(self) -> bool:
        return self.runner.has_pending_captures

    @property
    def has_wanted_captures(self) -> bool:
        return self.runner.has_wanted_captures

    def capture_pending(self) -> bool:
        self._check_idle(self._in_flight > 0)  # a capture rewrites the buffers a step reads
        return self.runner.capture_pending()

    def forget(self, request_ids: list[str]) -> None:
        if self._in_flight:
            self._forgets.extend(request_ids)
            return
        self._forget_now(request_ids)

    def _forget_now(self, request_ids: list[str]) -> None:
        # After a wait: a step still in flight (scheduled ahead) sampled only plain rows, which read
        # nothing a forget drops (a seeded generator was drawn from at its launch).
        for rid in request_ids:
            self.runner.forget(rid)
