"""A background build: kiln's forward built on a thread while the model serves eagerly.

``BackgroundBuild`` runs ``make_forward()`` and its build (capture, passes, Inductor, or a load
from the compile cache) on a thread at a lower priority; ``CompiledModel`` switches to the result
the step after it is done. What this module owns besides, and the rules it keeps:

- FX symbolic tracing (``torch.fx.Tracer.trace``, which reading a saved graph runs) patches
  ``nn.Module.__call__`` for the whole process, so while a build runs a trace and any call into
  the model's modules exclude each other (``EAGER_OR_TRACE``; ``eager_calls`` is what the steps hold).
- Builds in one process run one at a time (``ONE_BUILD``: Dynamo captures must not overlap).
- On CUDA the build's Python waits while a step runs (``StepGate``; ``compile.build_gate=false`` turns
  it off).
- A start-up that fails cancels its build (``BackgroundBuild.cancel``, at the safe points of
  ``kiln.compiler.cancel``), at most ``CANCEL_WAIT_S`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional

import torch

from kiln.compiler.cancel import cancellable, check_cancelled
from kiln.compiler.capture import KilnForward
from kiln.compiler.forward import build_now
from kiln.models.loader import Background, quick_gil_handoff

logger = logging.getLogger(__name__)

# How long a failed start-up waits for its background build to stop (``cancel_build``): the longest
# stretch between two of its safe points, an FX or Dynamo trace of the model, takes seconds.
CANCEL_WAIT_S = 30.0

# Held by an eager forward during a background build, and by every FX symbolic trace meanwhile.
EAGER_OR_TRACE = threading.RLock()
# Held by every build, at start-up or in the background: one Dynamo capture at a time in a process.
ONE_BUILD = threading.Lock()


@contextlib.contextmanager
def traces_exclude_eager_forwards() -> Iterator[None]:
    """For the length of a build: ``torch.fx.Tracer.trace`` takes ``EAGER_OR_TRACE``, since it
    patches ``nn.Module.__call__`` process-wide and an eager forward on another thread would be traced."""
    original = torch.fx.Tracer.trace

    def trace(self, *args, **kwargs):
        check_cancelled()
        with EAGER_OR_TRACE:
            return original(self, *args, **kwargs)

    torch.fx.Tracer.trace = trace
    try:
        yield
    finally:
        torch.fx.Tracer.trace = original


class StepGate:
    """Keeps a CUDA background build's Python out of the eager steps' way. The build's thread runs
    under ``sys.setprofile(hook)``; at each Python call it makes while a step runs (``step()``, taken
    by ``eager_calls``) it waits, the GIL released, until the step ends. Without it each torch op of
    an eager step, having released the GIL, waited to get it back from the build's imports and
    tracing. It cannot stop C calls that hold the GIL (module loads, unmarshal). After ``MAX_PARK_S``
    parked the build runs for ``PASS_S`` regardless, so that steps back to back still let it end.

    On an H200, Llama-3-8B from an on-disk checkpoint (benchmarks/results/startup-H200.md#startup-build-gate): the
    first token of a warm start came at 6.86 s against 9.32 s without it (the first eager step beside
    the build took 0.10 s against 1.84 s), and of a first start at 18.3 s against 26.7 s (the memory
    profile and warm-up ran beside the build). The hook slows the build's Python: kiln's forward
    arrived 1.0-1.1 s later on both starts. ``compile.build_gate=false`` turns it off."""

    MAX_PARK_S = 0.05
    PASS_S = 0.01

    def __init__(self) -> None:
        self.in_flight = 0
        self.idle = threading.Event()
        self.idle.set()
        self._pass_until = 0.0

    def hook(self, frame, event, arg) -> None:
        if event == "call" and self.in_flight and time.monotonic() > self._pass_until:
            if not self.idle.wait(self.MAX_PARK_S):
                self._pass_until = time.monotonic() + self.PASS_S

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()


class BackgroundBuild:
    """``make_forward()`` and its ``build(device)`` on a thread (``kiln.models.loader.Background``;
    a background build), under inference mode, at a lower CPU priority than the steps (the C++
    compiler processes it starts inherit it). Not the lowest: on a busy machine the build still gets
    about a quarter of a core it shares. Making the forward imports kiln's passes, Inductor and
    Dynamo, and the passes trace their patterns: all of it inside the trace lock.

    The thread starts with ``start``. The ``ModelRunner`` calls it once ready on a warm start: the
    build's imports and cache load are seconds of Python holding the GIL, and beside the weight read
    and the eager warm-up (which need the GIL between reads and ops) a warm start of Llama-3-8B on an
    H200 was ready at 15.2 s instead of 8.1 s. On a first CUDA start (no memory profile kept) it calls
    it as the weights start loading: compiling takes tens of seconds, and kiln's forward ran 10.9-13.4 s
    sooner, the first token 0.8-3.4 s later (benchmarks/results/startup-H200.md#startup-build-early)."""

    NICE = 5

    def __init__(self, make_forward: Callable[[], KilnForward], device: torch.device, gate: bool = True) -> None:
        self.forward: Optional[KilnForward] = None  # once built
        self.seconds = 0.0
        self._make_forward, self._device = make_forward, device
        self._task: Optional[Background] = None
        self._start_lock = threading.Lock()
        self._cancel = threading.Event()
        # CUDA only: on the CPU the steps hold the cores in long ops, and a parked build would mostly wait.
        self.gate = StepGate() if device.type == "cuda" and gate else None

    def start(self) -> None:
        """Start the build's thread (once; later calls do nothing)."""
        with self._start_lock:
            if self._task is None:
                logger.info("background build: building kiln's forward on a thread; steps run eagerly "
                            "until then")
                self._task = Background(self._build, "kiln-build")

    def _build(self) -> None:
        t0 = time.perf_counter()
        cuda = self._device.type == "cuda"
        try:
            with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.NICE)
            if cuda:  # the current device is per thread
                torch.cuda.set_device(self._device)
            if self.gate is not None:
                sys.setprofile(self.gate.hook)  # this thread's only
            # On CUDA, quick_gil_handoff: a thread waiting for the GIL gets it after 0.1 ms, not 5 ms.
            # Each torch op of an eager step releases the GIL and must get it back from the build's
            # Python: at 5 ms a wait, the first eager step of a warm Llama-3-8B start took 4.7 s on an
            # H200, 2.0 s at 0.1 ms (before StepGate). Not on the CPU, whose steps hold the cores in
            # long ops: on a 2-vCPU EPYC the eager steps beside the build ran no faster (16.2 against
            # 16.4 tok/s) and SmolLM2's build had not ended after 150 s, against 90 s at 5 ms
            # (python -m benchmarks.startup background-build).
            handoff = quick_gil_handoff() if cuda else contextlib.nullcontext()
            with cancellable(self._cancel), handoff, ONE_BUILD, traces_exclude_eager_forwards():
                check_cancelled()
                forward = self._make_forward()
                check_cancelled()
                build_now(forward, self._device)
            self.forward = forward
        finally:
            sys.setprofile(None)
            self.seconds = time.perf_counter() - t0

    def cancel(self, timeout: float) -> bool:
        """Stop the build at its next safe point (``kiln.compiler.cancel``) and wait at most
        ``timeout`` seconds for its thread to end; whether it has (or never started)."""
        self._cancel.set()
        if self.gate is not None:
            self.gate.idle.set()  # a build parked by a step that will not end
        return self._task is None or self._task.join(timeout)

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done

    @property
    def error(self) -> Optional[BaseException]:
        """What the build raised (reported by CompiledModel when it would switch)."""
        return self._task.error if self._task is not None else None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait at most ``timeout`` seconds (None: until done) for the build, starting it if it
        has not started; whether it has ended."""
        self.start()
        return self._task.join(timeout)


def eager_calls(building: Optional[BackgroundBuild]) -> contextlib.AbstractContextManager:
    """Held around every call into the model's modules while a background build runs: an FX trace
    on the build's thread patches ``nn.Module.__call__`` for the whole process, and would take in
    an eager forward or logits head on another thread (``EAGER_OR_TRACE``). On CUDA the build's
    Python also waits meanwhile (``StepGate``). Nothing without a build."""
    if building is None:
        return contextlib.nullcontext()
    if building.gate is None:
        return EAGER_OR_TRACE
    stack = contextlib.ExitStack()
    stack.enter_context(EAGER_OR_TRACE)  # first: a trace holding it ends before the gate closes
    stack.enter_context(building.gate.step())
    return stack
