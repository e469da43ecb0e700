"""``GraphSets``: a compiled model's CUDA graphs, which sizes are captured when, and which one a batch replays.

Three sets, each a ``FullCUDAGraphs`` or ``PiecewiseCUDAGraphs`` with its own sizes, all captured
into one memory pool (graphs never run concurrently)::

    full       uniform decode batches, per number of requests, ending in the logits and argmax
    verify     uniform verify batches (k + 1 tokens a request; ``set_verify_shape``), per requests
    piecewise  any batch up to the largest size, per number of tokens

``capture`` plans the sets and captures every size (or those up to ``max_size``); the others stay
pending for lazy capture, one size per ``capture_next`` between steps: first the sizes batches ran
without (``route`` notes them), then, after a background build, the small ones, then the rest
largest first. While kiln's forward is built in the background, ``capture`` only defers
(``deferred``) and ``plan_deferred`` plans the sets over the built forward once steps run it.

Rules kept here: capture happens only between steps, with none in flight (it rewrites the input
buffers and overwrites graph outputs in the pool); the forward a set is captured over is passed in,
never held beyond the sets made from it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, Optional

import torch

from kiln.compiler.capture import KilnForward
from kiln.compiler.cudagraph import FullCUDAGraphs, GraphMode, piecewise_capture_sizes, wanted_graph_modes
from kiln.compiler.inputs import InputBuffers, ModelInputs, VerifyShape, next_capture_size
from kiln.compiler.piecewise import GraphRecorder, PiecewiseCUDAGraphs
from kiln.config import ResolvedCompileConfig
from kiln.forward_context import ForwardContext

logger = logging.getLogger(__name__)

CaptureScope = Callable[[ForwardContext], ContextManager[None]]


def dispatch(full: Optional[FullCUDAGraphs], piecewise: Optional[PiecewiseCUDAGraphs],
             num_tokens: int, num_reqs: int, num_decodes: int,
             verify: Optional[FullCUDAGraphs] = None, query_len: int = 0) -> tuple[GraphMode, int]:
    """The path of one batch and the number of tokens it runs with, padding included::

        decode-only, requests fit a full size  -> FULL       (requests padded with null decodes)
        uniform verify: every request has verify.query_len tokens, requests fit a verify size
                                               -> FULL       (requests padded with null verifies)
        otherwise, tokens fit a piecewise size -> PIECEWISE  (tokens padded, attention sees the real ones)
        otherwise                              -> NONE       (the forward as built, no padding)

    ``full`` / ``piecewise`` / ``verify`` are None when that kind of graph is off; ``query_len``
    is the batch's ``ModelInputs.uniform_query_len`` (0: not uniform)."""
    if full is not None and num_decodes == num_reqs:
        size = full.padded_size(num_reqs)
        if size is not None:
            return GraphMode.FULL, size
    if verify is not None and query_len == verify.query_len and num_tokens == num_reqs * query_len:
        size = verify.padded_size(num_reqs)
        if size is not None:
            return GraphMode.FULL, size * query_len
    if piecewise is not None:
        size = piecewise.padded_size(num_tokens)
        if size is not None:
            return GraphMode.PIECEWISE, size
    return GraphMode.NONE, num_tokens


class GraphSets:
    """One compiled model's graph sets (``full``, ``verify``, ``piecewise``; None while not planned),
    captured over the forward and caches each call is given, through ``capture_scope``."""

    def __init__(self, config: ResolvedCompileConfig, inputs: InputBuffers, device: torch.device,
                 compute_logits: Callable, argmax: Callable, capture_scope: CaptureScope) -> None:
        self.config, self.inputs, self.device = config, inputs, device
        self._compute_logits, self._argmax = compute_logits, argmax  # the model's head, the KernelSet's argmax
        self.capture_scope = capture_scope  # the compiled model's forward scope, for capture
        self.full: Optional[FullCUDAGraphs] = None  # uniform decode batches
        self.verify: Optional[FullCUDAGraphs] = None  # uniform verify batches (set_verify_shape)
        self.verify_shape: Optional[VerifyShape] = None
        self.piecewise: Optional[PiecewiseCUDAGraphs] = None  # any batch up to the largest size
        self._pool: Optional[tuple] = None  # the one pool every graph is captured into
        self._any_pending = False  # planned sizes not captured yet (lazy capture)
        # a background build on CUDA: capture was called while building; its modes (None: the
        # config's) wait until plan_deferred plans the graphs over the built forward
        self.deferred = False
        self._deferred_modes: Optional[set[GraphMode]] = None
        self._wanted: list[tuple[Any, int]] = []  # (graphs, size) a batch ran without, not captured yet
        self._small_first: list[tuple[Any, int]] = []  # (graphs, size) captured next, once a build ends

    def sets(self) -> list:
        """The sets planned so far (any of full, verify, piecewise)."""
        return [g for g in (self.full, self.verify, self.piecewise) if g is not None]

    def set_verify_shape(self, shape: Optional[VerifyShape]) -> None:
        if self.full is not None:
            raise RuntimeError("set the verify shape before capturing CUDA graphs")
        self.verify_shape = shape if shape is not None and shape.query_len > 1 else None

    # ---- planning and capture ---------------------------------------------------------------------
    def capture(self, forward: Callable, kv_caches: list[torch.Tensor], building: bool,
                record: Optional[GraphRecorder] = None, modes: Optional[set[GraphMode]] = None,
                max_size: Optional[int] = None) -> None:
        """``CompiledModel.capture_graphs`` over ``forward`` and ``kv_caches``; ``building``: a
        background build runs, so (without ``record``) nothing is captured yet, only deferred."""
        has_pieces = isinstance(forward, KilnForward) or building
        planned = modes
        if modes is None:
            modes = wanted_graph_modes(self.config.cudagraph, has_pieces) if self.device.type == "cuda" else set()
        if not modes:
            return
        if not kv_caches:
            raise RuntimeError("bind the KV caches before capturing CUDA graphs")
        if building and record is None:
            self.deferred, self._deferred_modes, self._any_pending = True, planned, True
            logger.info("CUDA graphs: captured between steps once kiln's forward is built")
            return
        pool = self._pool = torch.cuda.graph_pool_handle() if record is None else None

        def capture(graphs) -> None:
            sizes = graphs.pending_sizes if max_size is None else [s for s in graphs.pending_sizes if s <= max_size]
            graphs.capture(self.capture_scope, kv_caches, pool, sizes=sizes)

        if GraphMode.FULL in modes:
            self.full = self.make_full(forward, self.config.capture_sizes)
            capture(self.full)
            if self.verify_shape is not None:
                self.verify = self.make_verify(forward, self.config.capture_sizes)
                capture(self.verify)
        if GraphMode.PIECEWISE in modes:
            sizes = piecewise_capture_sizes(self.config.capture_sizes, modes)
            self.piecewise = PiecewiseCUDAGraphs(forward, self.inputs, sizes, record)
            capture(self.piecewise)
        self._any_pending = self.num_pending > 0

    def plan_deferred(self, forward: Callable, kv_caches: list[torch.Tensor]) -> None:
        """The background build has ended (``forward`` is what steps run now): plan the deferred
        graphs over it, every size pending, the small ones first in line."""
        self.deferred, modes = False, self._deferred_modes
        if modes is not None and not isinstance(forward, KilnForward):  # the build failed
            modes = modes - {GraphMode.PIECEWISE}
        self.capture(forward, kv_caches, building=False, modes=modes, max_size=0)
        # First the sizes a start that captures before ready takes (the first requests' decodes),
        # smallest first; then the rest, largest first.
        small = self.config.startup_capture_max
        self._small_first = [(g, s) for g in self.sets() for s in sorted(g.pending_sizes) if s <= small]

    def capture_next(self, kv_caches: list[torch.Tensor]) -> Optional[int]:
        """Capture one pending size (``CompiledModel.capture_next``); the size, or None."""
        nxt = self._next_capture()
        if nxt is None:
            self._any_pending = False
            return None
        graphs, size = nxt
        graphs.capture(self.capture_scope, kv_caches, self._pool, log=False, sizes=[size])
        self._any_pending = self.num_pending > 0
        return size

    def _next_capture(self) -> Optional[tuple[Any, int]]:
        for queue in (self._wanted, self._small_first):
            while queue:
                graphs, size = queue.pop(0)
                if size in graphs.pending_sizes:
                    return graphs, size
        graphs = next((g for g in self.sets() if g.pending_sizes), None)
        return (graphs, graphs.pending_sizes[-1]) if graphs is not None else None

    def drop_pending(self) -> None:
        self._any_pending = self.deferred = False
        self._wanted.clear()
        self._small_first.clear()

    @property
    def num_pending(self) -> int:
        return sum(len(g.pending_sizes) for g in self.sets())

    @property
    def has_pending(self) -> bool:
        return self.deferred or self.num_pending > 0

    def has_wanted(self, build_done: bool) -> bool:
        """Whether a batch ran without a size still pending, or (``build_done``: no background
        build still runs) deferred graphs wait to be planned."""
        return bool(self._wanted) or (self.deferred and build_done)

    # ---- one step ---------------------------------------------------------------------------------
    def route(self, inputs: ModelInputs) -> tuple[GraphMode, int]:
        """``dispatch`` for one step (a step with image embeddings runs without graphs); with sizes
        pending, note the one this step would have replayed."""
        n, num_reqs = inputs.num_tokens, inputs.num_reqs
        mode, padded = dispatch(self.full, self.piecewise, n, num_reqs, inputs.num_decodes, self.verify,
                                inputs.uniform_query_len)
        if inputs.mm_embeds is not None:
            mode, padded = GraphMode.NONE, n
        if self._any_pending:
            self._want_graph(n, num_reqs, inputs.num_decodes, mode)
        return mode, padded

    def _want_graph(self, num_tokens: int, num_reqs: int, num_decodes: int, mode: GraphMode) -> None:
        """Lazy capture, after dispatch: note the size this batch would replay were every planned size
        captured, when it is not (the batch ran on a larger size or without graphs)."""
        full, pieces = self.full, self.piecewise
        want = None
        if full is not None and num_decodes == num_reqs:
            size = next_capture_size(full.sizes, num_reqs)
            if size is not None:
                want = (full, size)
        if want is None and pieces is not None and mode is not GraphMode.FULL:
            size = next_capture_size(pieces.sizes, num_tokens)
            if size is not None:
                want = (pieces, size)
        if want is not None and want[1] in want[0].pending_sizes and want not in self._wanted:
            self._wanted.append(want)

    # ---- sizes and the sets' makers (also the memory profile's) ------------------------------------
    def sizes(self, modes: set[GraphMode]) -> list[int]:
        """Every size some graph of ``modes`` is captured at (the union of full and piecewise sizes)."""
        buf, sizes = self.inputs, set()
        if GraphMode.FULL in modes:
            sizes |= {s for s in self.config.capture_sizes if s <= min(buf.max_num_reqs, buf.max_num_tokens)}
        if GraphMode.PIECEWISE in modes:
            sizes |= {s for s in piecewise_capture_sizes(self.config.capture_sizes, modes) if s <= buf.max_num_tokens}
        return sorted(sizes)

    def make_verify(self, forward: Callable, capture_sizes) -> FullCUDAGraphs:
        shape = self.verify_shape
        return self.make_full(forward, capture_sizes, query_len=shape.query_len, max_num_reqs=shape.max_num_reqs)

    def make_full(self, forward: Callable, capture_sizes, **kwargs) -> FullCUDAGraphs:
        """Whole-forward graphs ending in the logits and their argmax (the KernelSet's)."""
        return FullCUDAGraphs(forward, self.inputs, capture_sizes, compute_logits=self._compute_logits,
                              argmax=self._argmax, **kwargs)

    @property
    def capture_seconds(self) -> float:
        return sum(g.capture_seconds for g in self.sets())

    @property
    def memory_bytes(self) -> int:
        return sum(g.memory_bytes for g in self.sets())
