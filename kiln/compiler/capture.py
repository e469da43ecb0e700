"""``KilnForward``: ``compile.mode=kiln`` as a callable ``(input_ids, positions) -> hidden``.

``build`` (the model runner calls it at start-up), or else the first call, captures the model
with Dynamo through ``KilnBackend``, ``num_tokens`` (dim 0 of
``input_ids`` and ``positions``) marked dynamic. Sizes 0 and 1 are not specialized: the capture
runs with ``backed_size_oblivious``, so a first batch of one token captures the same general
graph as any other.

Every later call skips Dynamo: no guards are evaluated and no recompile can happen. The graph's
inputs were resolved once from their Dynamo sources: parameters and buffers are constant (the
tensors themselves; ``load_weights`` copies into them in place), ``input_ids``/``positions`` are
the call's arguments, and the symbolic size is ``input_ids.shape[0]``. That is only sound because
the captured forward has no data-dependent Python branches and the model's structure never
changes after capture (``kiln.models.llama`` keeps both rules).

With an artifact cache entry (``kiln.compiler.artifact_cache``), the build first tries to load
the split graph, its compiled pieces and the argument plan from disk: a hit runs neither Dynamo nor
Inductor, and binds the plan to this model's parameters and buffers by qualified name. A miss
captures as above and stores what it built.

A model may shape its own capture: ``model.capture_scope()``, when it has one, is entered around
Dynamo's trace (the generic path captures its attention as SDPA there, for the attention pass).

Call it under ``torch.inference_mode()`` or ``torch.no_grad()`` (the model runner does); the
compiled pieces are inference graphs.
"""

from __future__ import annotations

import logging
import re
import time
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from kiln.compiler.artifact_cache import CacheEntry
from kiln.compiler.cancel import check_cancelled
from kiln.compiler.piece import CompiledPiece
from kiln.compiler.saved_forward import SavedForward, record_cpp_binaries, write_forward

if TYPE_CHECKING:  # imports the passes, and they Inductor: only kiln.compiler.forward's build does
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

    def to_json(self, model: nn.Module) -> list[dict[str, Any]]:
        """Each graph input by name: a call argument, its size, or a parameter/buffer's qualified name."""
        names = {id(t): n for n, t in reversed(_named_tensors(model))}
        items: list[dict[str, Any]] = [{} for _ in self.template]
        for i, j in self.tensor_slots:
            items[i] = {"arg": _ARG_NAMES[j]}
        for i, j, dim in self.size_slots:
            items[i] = {"size_of": _ARG_NAMES[j], "dim": dim}
        for i, t in enumerate(self.template):
            if t is not None:
                if id(t) not in names:
                    raise RuntimeError(f"graph input {i} is not a parameter or buffer of the model")
                items[i] = {"tensor": names[id(t)]}
        return items

    @classmethod
    def from_json(cls, items: list[dict[str, Any]], model: nn.Module) -> "_CallPlan":
        tensors = dict(_named_tensors(model))
        template: list[Any] = []
        tensor_slots, size_slots = [], []
        for i, item in enumerate(items):
            template.append(tensors[item["tensor"]] if "tensor" in item else None)
            if "arg" in item:
                tensor_slots.append((i, _ARG_NAMES.index(item["arg"])))
            elif "size_of" in item:
                size_slots.append((i, _ARG_NAMES.index(item["size_of"]), int(item["dim"])))
        return cls(template, tensor_slots, size_slots)

    def args(self, call_args: tuple[torch.Tensor, torch.Tensor]) -> list[Any]:
        out = list(self.template)
        for i, j in self.tensor_slots:
            out[i] = call_args[j]
        for i, j, dim in self.size_slots:
            out[i] = call_args[j].shape[dim]
        return out


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


class KilnForward:
    """Capture once (or load from the artifact cache), then call the split graph of compiled pieces."""

    _num_instances = 0

    def __init__(self, model: nn.Module, backend: KilnBackend, depyf_context: Optional[Callable] = None,
                 cache: Optional[CacheEntry] = None) -> None:
        self.model = model
        self.backend = backend
        self._depyf_context = depyf_context
        self.cache = cache
        self.cache_hit = False
        self.cache_load_seconds = 0.0
        self.dynamo_seconds = 0.0  # the capture without its Inductor builds (Dynamo, passes, split)
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

    @property
    def inductor_seconds(self) -> float:
        return self.backend.compiler.compile_seconds

    @property
    def split_graph(self) -> Optional[torch.fx.GraphModule]:
        """The split graph every call runs (compiled pieces and attention calls); None before the build."""
        return self._graph

    def constant_inputs(self) -> list[torch.Tensor]:
        """The graph inputs that are the same tensors on every call: parameters and buffers."""
        if self._plan is None:
            raise RuntimeError("build the forward first")
        return [t for t in self._plan.template if isinstance(t, torch.Tensor)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._graph is None:
            self._build(input_ids.device, input_ids.dtype, positions.dtype)
        return self._graph(*self._plan.args((input_ids, positions)))[0]

    def build(self, device: torch.device) -> None:
        """Load from the artifact cache or capture now (at start-up), not at the first call."""
        if self._graph is None:
            self._build(device, torch.int64, torch.int64)

    def _build(self, device: torch.device, ids_dtype: torch.dtype, pos_dtype: torch.dtype) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError("compile.mode=kiln builds inference graphs: call it under torch.inference_mode()")
        if self.cache is not None and self._load():
            return
        check_cancelled()
        logger.info("kiln: capturing and compiling the model (compile.mode=kiln)%s",
                    "; later starts load it from the compile cache" if self.cache is not None else "")
        with record_cpp_binaries() as cpp_binaries:
            self._capture(device, ids_dtype, pos_dtype)
        if self.cache is not None:
            self._store(cpp_binaries)

    def _load(self) -> bool:
        t0 = time.perf_counter()
        loaded = self.cache.load()
        if loaded is None:
            return False
        self._graph = loaded.split_gm
        self._plan = _CallPlan.from_json(loaded.args, self.model)
        self.cache_hit = True
        self.cache_load_seconds = time.perf_counter() - t0
        return True

    def _store(self, cpp_binaries: set[str]) -> None:
        try:
            args = self._plan.to_json(self.model)
        except RuntimeError as e:
            logger.warning("kiln: not storing the compiled forward: %s", e)
            return
        pieces = {n: v for n, v in self._graph.__dict__.items() if isinstance(v, CompiledPiece)}
        compiler = self.backend.compiler
        saved = SavedForward(self._graph, pieces, {k: compiler.returns_one_value(k) for k in compiler.cache},
                             args, cpp_binaries)
        self.cache.store(lambda entry_dir: write_forward(entry_dir, saved))

    def _capture(self, device: torch.device, ids_dtype: torch.dtype, pos_dtype: torch.dtype) -> None:
        """Capture on dummy inputs of ``CAPTURE_NUM_TOKENS`` (never executed).

        The capture size is fixed, not the first batch's: Inductor makes size-dependent choices
        from the example size (a batch of 1 would get matmuls specialized to one row), and a
        fixed size keeps those choices, and the cache keys, the same on every start.
        """
        t0 = time.perf_counter()
        n = CAPTURE_NUM_TOKENS
        dummy_ids = torch.zeros(n, dtype=ids_dtype, device=device)
        dummy_pos = torch.arange(n, dtype=pos_dtype, device=device)
        for t in (dummy_ids, dummy_pos):
            torch._dynamo.mark_dynamic(t, 0)
        fn = torch.compile(_fresh_capture_fn(self._tag), backend=self.backend, fullgraph=True, dynamic=False)
        with self.backend.compiler.progress():
            self.backend.dry_run = True
            try:
                # A model may capture in a form of its own (the generic path: attention as SDPA).
                capture_scope = getattr(self.model, "capture_scope", None) or _null
                with fx_config.patch(backed_size_oblivious=True), (self._depyf_context or _null)(), capture_scope():
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
        self.dynamo_seconds = time.perf_counter() - t0 - self.inductor_seconds

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
        }
        if self._dynamo_fn is not None:  # None after a cache hit: Dynamo never ran
            paths["dynamo_guarded"] = lambda: self._dynamo_fn(self.model, input_ids, positions)
        out = {"dynamo_guarded": float("nan")}
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
