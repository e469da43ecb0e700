"""``KilnForward``: ``compile.mode=kiln`` as a callable ``(input_ids, positions) -> hidden``.

The first call captures the model with Dynamo through ``KilnBackend``, ``num_tokens`` (dim 0 of
``input_ids`` and ``positions``) marked dynamic. Sizes 0 and 1 are not specialized: the capture
runs with ``backed_size_oblivious``, so a first batch of one token captures the same general
graph as any other.

Every later call skips Dynamo: no guards are evaluated and no recompile can happen. The graph's
inputs were resolved once from their Dynamo sources: parameters and buffers are constant (the
tensors themselves; ``load_weights`` copies into them in place), ``input_ids``/``positions`` are
the call's arguments, and the symbolic size is ``input_ids.shape[0]``. That is only sound because
the captured forward has no data-dependent Python branches and the model's structure never
changes after capture (``kiln.models.llama`` keeps both rules).

Call it under ``torch.inference_mode()`` or ``torch.no_grad()`` (the model runner does); the
compiled pieces are inference graphs.
"""

from __future__ import annotations

import logging
import re
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from kiln.compiler.backend import KilnBackend

logger = logging.getLogger(__name__)

_INPUT = re.compile(r"^L\['(\w+)'\]$")
_INPUT_SIZE = re.compile(r"^L\['(\w+)'\]\.size\(\)\[(\d+)\]$")
_ARG_NAMES = ("input_ids", "positions")
CAPTURE_NUM_TOKENS = 64  # the example size Dynamo and Inductor see; any size runs afterwards


def _call_model(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return model(input_ids, positions)


def _fresh_capture_fn(tag: int) -> Callable:
    """A function of its own code object, so this capture's Dynamo cache entry is never shared
    with (or counted against the recompile limit of) another model in the same process."""
    code = _call_model.__code__.replace(co_name=f"kiln_capture_{tag}")
    return types.FunctionType(code, _call_model.__globals__, code.co_name)


@dataclass
class _CallPlan:
    """How to build the compiled graph's arguments from (input_ids, positions)."""

    template: list[Any]  # constants in place, None where a per-call value goes
    tensor_slots: list[tuple[int, int]]  # (graph arg index, call arg index)
    size_slots: list[tuple[int, int, int]]  # (graph arg index, call arg index, dim)

    @classmethod
    def from_sources(cls, sources: list[str], example_inputs: list[Any]) -> "_CallPlan":
        template: list[Any] = []
        tensor_slots, size_slots = [], []
        for i, (src, example) in enumerate(zip(sources, example_inputs)):
            m_in, m_size = _INPUT.match(src), _INPUT_SIZE.match(src)
            if m_in and m_in.group(1) in _ARG_NAMES:
                tensor_slots.append((i, _ARG_NAMES.index(m_in.group(1))))
                template.append(None)
            elif m_size and m_size.group(1) in _ARG_NAMES:
                size_slots.append((i, _ARG_NAMES.index(m_size.group(1)), int(m_size.group(2))))
                template.append(None)
            elif isinstance(example, torch.Tensor):
                template.append(example)  # a parameter or buffer: constant across calls
            else:
                raise RuntimeError(f"kiln: graph input {src} ({type(example).__name__}) is neither a call "
                                   "argument, its size, nor a tensor; cannot call the graph without guards")
        return cls(template, tensor_slots, size_slots)

    def args(self, call_args: tuple[torch.Tensor, torch.Tensor]) -> list[Any]:
        out = list(self.template)
        for i, j in self.tensor_slots:
            out[i] = call_args[j]
        for i, j, dim in self.size_slots:
            out[i] = call_args[j].shape[dim]
        return out


class KilnForward:
    """Capture once, then call the split graph of compiled pieces directly."""

    _num_instances = 0

    def __init__(self, model: nn.Module, backend: KilnBackend, depyf_context: Optional[Callable] = None) -> None:
        self.model = model
        self.backend = backend
        self._depyf_context = depyf_context
        self._graph: Optional[torch.fx.GraphModule] = None
        self._plan: Optional[_CallPlan] = None
        self._dynamo_fn: Optional[Callable] = None  # kept only to measure guard overhead
        KilnForward._num_instances += 1
        self._tag = KilnForward._num_instances

    @property
    def num_captures(self) -> int:
        return self.backend.num_captures

    @property
    def num_recompiles(self) -> int:
        """Captures after the first. Stays 0: after capture Dynamo is never called again."""
        return max(0, self.backend.num_captures - 1)

    @property
    def num_compiles(self) -> int:
        """Inductor builds, after identical pieces were merged."""
        return self.backend.compiler.num_compiles

    @property
    def compile_seconds(self) -> float:
        return self.backend.capture_seconds

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._graph is None:
            return self._capture(input_ids, positions)
        return self._graph(*self._plan.args((input_ids, positions)))[0]

    def _capture(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Capture on dummy inputs of ``CAPTURE_NUM_TOKENS`` (never executed), then run the call.

        The capture size is fixed, not the first batch's: Inductor makes size-dependent choices
        from the example size (a batch of 1 would get matmuls specialized to one row), and a
        fixed size keeps those choices, and the cache keys, the same on every start.
        """
        if torch.is_grad_enabled():
            raise RuntimeError("compile.mode=kiln builds inference graphs: call it under torch.inference_mode()")
        n = CAPTURE_NUM_TOKENS
        dummy_ids = torch.zeros(n, dtype=input_ids.dtype, device=input_ids.device)
        dummy_pos = torch.arange(n, dtype=positions.dtype, device=positions.device)
        for t in (dummy_ids, dummy_pos):
            torch._dynamo.mark_dynamic(t, 0)
        fn = torch.compile(_fresh_capture_fn(self._tag), backend=self.backend, fullgraph=True, dynamic=False)
        self.backend.dry_run = True
        try:
            with fx_config.patch(backed_size_oblivious=True), (self._depyf_context or _null)():
                fn(self.model, dummy_ids, dummy_pos)
        finally:
            self.backend.dry_run = False
        capture = self.backend.capture
        if capture is None:
            raise RuntimeError("kiln: Dynamo did not call the kiln backend")
        self.backend.compile_static_sizes()
        self._graph = capture.split_gm
        self._plan = _CallPlan.from_sources(capture.sources, capture.example_inputs)
        self._dynamo_fn = fn
        return self(input_ids, positions)

    def time_call_paths(self, input_ids: torch.Tensor, positions: torch.Tensor, iters: int = 200) -> dict[str, float]:
        """Mean µs per call of: the Dynamo-compiled function (guards, then the graph), this
        object's direct call (argument plan, then the graph), and the pieces alone (each piece and
        attention call with its arguments precomputed). Run inside a forward context.

        The guarded path is only timed where Dynamo's guards accept the size (not at 1 token,
        which they exclude: there Dynamo would recompile); elsewhere it is reported as NaN.
        """
        if self._graph is None:
            raise RuntimeError("call the forward once before timing it")
        recorded = _record_piece_calls(self._graph, self._plan.args((input_ids, positions)))
        paths = {
            "kiln_direct": lambda: self(input_ids, positions),
            "pieces_only": lambda: [fn(*args) for fn, args in recorded],
            "dynamo_guarded": lambda: self._dynamo_fn(self.model, input_ids, positions),
        }
        out = {}
        for name, call in paths.items():
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    out[name] = _mean_us(call, iters)
            except RuntimeError as e:
                logger.info("not timing %s: %s", name, str(e).splitlines()[0])
                out[name] = float("nan")
        return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _record_piece_calls(graph: torch.fx.GraphModule, args: list[Any]) -> list[tuple[Callable, tuple]]:
    """Run the split graph once, recording each submodule call with its (real) arguments."""
    recorded: list[tuple[Callable, tuple]] = []

    class Recorder(torch.fx.Interpreter):
        def call_module(self, target, a, kwargs):
            fn = self.fetch_attr(target)
            recorded.append((fn, tuple(a)))
            return fn(*a)

    Recorder(graph).run(*args)
    return recorded


def _mean_us(call: Callable[[], Any], iters: int) -> float:
    for _ in range(3):
        call()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters * 1e6
