"""Piecewise CUDA graphs: the pieces between attention ops captured per capture size, attention eager.

``compile.cudagraph=piecewise``, and the half of ``full_and_piecewise`` that serves mixed batches.
In ``compile.mode=kiln`` the forward is a split graph (``kiln.compiler.split``): compiled pieces with
one attention call between each two. ``PiecewiseCUDAGraphs`` installs a ``PieceGraphs`` wrapper over
every piece call and an ``AttentionCall`` wrapper over every attention call (instance attributes
shadowing the submodules, as the backend installs compiled pieces). A batch of ``n`` tokens runs
padded to the next capture size ``S``::

    input_ids, positions [S]  (InputBuffers views: the addresses the graphs were captured with)
        │
    piece 0 graph[S] ─q,k,v [S]─> attention, eager ─o [S]─> piece 1 graph[S] ─> ... ─> hidden [S, H]
        │                         on q,k,v[:n] and the       ▲  reads the attention buffer in place
        │                         real metadata; o -> the    │
        │                         attention buffer[:n]       │
        └─ residual, cos/sin: static outputs, read in place by later piece graphs

    rows: [0 ........... n) real tokens   [n ...... S) padding: token 0, position 0, slot 0 of the
                                                       null block; never attended to, never sampled

Rules kept here:
- Captures happen at start-up (``capture``, once the KV cache exists) or, with
  lazy capture (``compile.startup`` auto or fast), between engine steps; each call captures largest size first, all piece
  graphs in one memory pool. A batch replays only a captured size (``padded_size``). Outside
  ``replaying`` and ``capture`` every wrapper calls straight through: that is the no-graph path,
  and the capture of full graphs, which must not nest.
- A piece graph finds its inputs at the addresses it was captured with. By construction they are
  there: step inputs are InputBuffers views, piece outputs are earlier graphs' static outputs, and
  attention writes into one buffer shared by all attention calls (each attention output feeds only
  the next piece, checked at install; a call site where that does not hold gets a buffer of its
  own). As a safety net, a tensor input that arrives at another address is copied in; parameters
  and buffers are never checked. Non-tensor inputs (num_tokens) must equal the captured ones.
- Attention sees only the ``n`` real tokens with the real metadata, so the KV store writes and the
  kernels attend exactly as without graphs. Its padded output rows keep earlier values (zeros or
  real outputs, always finite); every piece op works row by row, so padding stays in its rows.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from kiln.compiler.capture import KilnForward
from kiln.compiler.cudagraph import format_sizes, graph_capture, weak_refs
from kiln.compiler.inputs import InputBuffers, next_capture_size
from kiln.compiler.piece import CompiledPiece
from kiln.forward_context import ForwardContext

logger = logging.getLogger(__name__)

# ``record(run) -> (replay, outputs)``: captures ``run`` (one piece call on its static inputs) as a
# graph; ``replay()`` runs it again, leaving its results in ``outputs``. Tests emulate it on CPU.
GraphRecorder = Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]]


def cuda_graph_recorder(pool: tuple) -> GraphRecorder:
    def record(run: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, pool):  # no device sync: the earlier pieces' replays run meanwhile
            outputs = run()
        graph.replay()  # capturing runs nothing: fill the outputs the rest of the capture pass reads
        return graph.replay, outputs

    return record


@dataclass(frozen=True)
class _Step:
    size: int  # S: the capture size the batch runs at
    num_tokens: int  # n <= S real tokens; rows [n, S) are padding
    capturing: bool


@dataclass
class _PieceGraph:
    replay: Callable[[], None]
    args: list[Any]  # the static inputs, as captured
    outputs: Any  # the static outputs, returned by every replay
    checked: list[int]  # tensor inputs other than parameters and buffers: compared by address
    scalars: list[tuple[int, Any]]  # (index, value) of the non-tensor inputs


class PieceGraphs:
    """One compiled piece at one call site of the split graph, with its captured graph per size.
    Identical pieces share a compiled build but not a graph: each call site reads its own weights."""

    def __init__(self, name: str, inner: CompiledPiece, owner: PiecewiseCUDAGraphs) -> None:
        self.name, self.inner, self.owner = name, inner, owner
        self.graphs: dict[int, _PieceGraph] = {}

    def __call__(self, *args: Any) -> Any:
        step = self.owner.step
        if step is None:
            return self.inner(*args)
        if step.capturing:
            return self._capture(step.size, args)
        return self._replay(self.graphs[step.size], args)

    def _capture(self, size: int, args: tuple) -> Any:
        self.inner(*args)  # warm-up: first-call work (kernel loads, cuBLAS handles) stays out of the graph
        replay, outputs = self.owner.record(lambda: self.inner(*args))
        constant_ids = self.owner.constant_ids
        checked = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and id(a) not in constant_ids]
        scalars = [(i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
        self.graphs[size] = _PieceGraph(replay, list(args), outputs, checked, scalars)
        return outputs

    def _replay(self, graph: _PieceGraph, args: tuple) -> Any:
        for i in graph.checked:
            arg, static = args[i], graph.args[i]
            if arg is not static and arg.data_ptr() != static.data_ptr():  # `is`: earlier graphs' outputs
                static.copy_(arg)
        for i, value in graph.scalars:
            if args[i] != value:
                raise RuntimeError(f"{self.name}: input {i} is {args[i]!r}, its graph was captured with {value!r}")
        graph.replay()
        return graph.outputs


class AttentionCall:
    """One attention call of the split graph: eager on the real tokens, its output written into the
    first rows of a persistent buffer of ``S`` rows, which the next piece graph reads in place."""

    def __init__(self, name: str, inner: torch.nn.Module, owner: PiecewiseCUDAGraphs, buffer_key: str) -> None:
        self.name, self.inner, self.owner = name, inner, owner
        self.buffer_key = buffer_key  # "shared", or the call site's name when its output lives longer
        self.buffer: Optional[torch.Tensor] = None  # [max size, ...] rows of the attention output

    def __call__(self, *args: Any) -> Any:
        step = self.owner.step
        if step is None:
            return self.inner(*args)
        size, n = step.size, step.num_tokens
        if n < size:
            args = tuple(_real_rows(a, size, n) for a in args)
        out = self.inner(*args)  # [n, num_heads, head_dim]
        if self.buffer is None:
            self.buffer = self.owner.attention_buffer(self.buffer_key, out)
        dst = self.buffer[:size]
        dst[:n].copy_(out)
        return dst


def _real_rows(arg: Any, size: int, n: int) -> Any:
    """An attention input cut to the real tokens: tensors of ``size`` rows, and num_tokens itself."""
    if isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] == size:
        return arg[:n]
    if isinstance(arg, int) and arg == size:
        return n
    return arg


class PiecewiseCUDAGraphs:
    """The piece graphs of one ``KilnForward`` per capture size, and the switch its wrappers read.

    Sizes above ``buffers.max_num_tokens`` are dropped. ``record`` (tests) replaces CUDA graph
    capture; by default pieces are captured as CUDA graphs in the pool given to ``capture``."""

    def __init__(self, forward: KilnForward, buffers: InputBuffers, capture_sizes: tuple[int, ...],
                 record: Optional[GraphRecorder] = None) -> None:
        if forward.split_graph is None:
            raise RuntimeError("build the kiln forward before capturing its pieces")
        self.forward, self.buffers, self.record = forward, buffers, record
        self.sizes = sorted(s for s in capture_sizes if s <= buffers.max_num_tokens)  # planned
        self.constant_ids = {id(t) for t in forward.constant_inputs()}
        self.step: Optional[_Step] = None  # set only inside replaying() and capture()
        self.captured_sizes: set[int] = set()
        self._captured_sorted: list[int] = []
        self._attention_buffers: dict[tuple, torch.Tensor] = {}
        self.pieces, self.attention_calls = self._install(forward.split_graph)
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def padded_size(self, num_tokens: int) -> Optional[int]:
        """The smallest captured size that holds ``num_tokens`` tokens, or None."""
        return next_capture_size(self._captured_sorted, num_tokens)

    @property
    def pending_sizes(self) -> list[int]:
        """Planned sizes not captured yet, ascending."""
        return [s for s in self.sizes if s not in self.captured_sizes]

    @contextlib.contextmanager
    def replaying(self, size: int, num_tokens: int) -> Iterator[None]:
        """Inside, a forward call replays the graphs of ``size`` for ``num_tokens`` real tokens. The
        caller pads the step inputs to ``size`` rows and gives attention the real batch's metadata."""
        if size not in self.captured_sizes or not 0 < num_tokens <= size:
            raise ValueError(f"no piecewise graphs of size {size} for {num_tokens} tokens "
                             f"(captured: {sorted(self.captured_sizes)})")
        with self._running(_Step(size, num_tokens, capturing=False)):
            yield

    @torch.inference_mode()
    def capture(self, scope: Callable[[ForwardContext], ContextManager[None]], kv_caches: list[torch.Tensor],
                pool: Optional[tuple] = None, log: bool = True, sizes: Optional[list[int]] = None) -> None:
        """Capture every piece at ``sizes`` (default: every planned size not captured yet), largest
        first, into ``pool`` (else a new one; later calls keep the first call's): one forward per
        size over a one-token decode of the null block, padded to the size. Once a size is captured
        its pieces' inputs and outputs are held weakly (``weak_refs``), so the next size's capture
        reuses their memory. Time and memory add up over calls."""
        sizes = self.pending_sizes if sizes is None else sorted(set(sizes) & set(self.pending_sizes))
        if not sizes:
            return
        is_cuda = self.buffers.device.type == "cuda"
        if self.record is None:
            self.record = cuda_graph_recorder(pool if pool is not None else torch.cuda.graph_pool_handle())
        if is_cuda:
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        buf = self.buffers
        for size in reversed(sizes):
            if is_cuda:
                torch.cuda.synchronize()  # the last size's uploads have read the host buffers rewritten here
            buf.qsl_np[0] = 0
            buf.fill_null_requests(0, 0, 1)
            buf.pad_tokens(1, size)
            buf.upload(size, 1)
            ctx = ForwardContext(attn=buf.metadata(1, 1, 1, [1], [1]), kv_caches=kv_caches)
            with scope(ctx), self._running(_Step(size, 1, capturing=True)):
                self.forward(buf.input_ids[:size], buf.positions[:size])
            for piece in self.pieces:
                graph = piece.graphs.get(size)
                if graph is not None:
                    graph.args, graph.outputs = weak_refs(graph.args), weak_refs(graph.outputs)
            self.captured_sizes.add(size)
            bisect.insort(self._captured_sorted, size)
        memory_bytes = 0
        if is_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # blocks of the eager attention calls, outside the graph pool
            memory_bytes = free_before - torch.cuda.mem_get_info()[0]
        seconds = time.perf_counter() - t0
        self.capture_seconds += seconds
        self.memory_bytes += memory_bytes
        if log:
            logger.info("CUDA graphs (piecewise): captured %d pieces at %d sizes %s in %.2f s, using %.0f MiB "
                        "of GPU memory%s", len(self.pieces), len(sizes), format_sizes(sizes), seconds,
                        memory_bytes / 2**20,
                        f"; {len(self.pending_sizes)} sizes left to capture" if self.pending_sizes else "")

    def release(self) -> None:
        """Take this instance's wrappers out of the split graph (the forward calls its pieces and
        attention directly again); the graphs are freed once this instance is."""
        gm = self.forward.split_graph
        for wrapper in [*self.pieces, *self.attention_calls]:
            if gm.__dict__.get(wrapper.name) is wrapper:
                gm.__dict__[wrapper.name] = wrapper.inner
        self.step = None

    def attention_buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The persistent output buffer of attention calls under ``key``: ``like``'s rows, max size."""
        full_key = (key, tuple(like.shape[1:]), like.dtype)
        if full_key not in self._attention_buffers:
            if self.step is None or not self.step.capturing:
                raise RuntimeError("attention buffers are allocated while capturing, never while serving")
            # Zeros: padded rows are read before any real output has landed in them.
            shape = (self.sizes[-1], *like.shape[1:])
            self._attention_buffers[full_key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self._attention_buffers[full_key]

    @contextlib.contextmanager
    def _running(self, step: _Step) -> Iterator[None]:
        if self.step is not None:
            raise RuntimeError("piecewise graphs are already running a step")
        self.step = step
        try:
            yield
        finally:
            self.step = None

    def _install(self, gm: torch.fx.GraphModule) -> tuple[list[PieceGraphs], list[AttentionCall]]:
        """Shadow every submodule call of the split graph with its wrapper."""
        calls = [n for n in gm.graph.nodes if n.op == "call_module"]
        pieces, attention = [], []
        for i, node in enumerate(calls):
            name = node.target
            inner = gm.__dict__.get(name)
            if isinstance(inner, (PieceGraphs, AttentionCall)):  # installed by an earlier instance
                inner = inner.inner
            if isinstance(inner, CompiledPiece):
                wrapper = PieceGraphs(name, inner, self)
                pieces.append(wrapper)
            else:
                # The shared buffer is rewritten by the next attention call: only safe when this
                # output is read by the very next piece alone.
                only_next = i + 1 < len(calls) and all(user is calls[i + 1] for user in node.users)
                inner = inner if inner is not None else gm.get_submodule(name)
                wrapper = AttentionCall(name, inner, self, "shared" if only_next else name)
                attention.append(wrapper)
            gm.__dict__[name] = wrapper
        return pieces, attention
