"""``CompiledModel``: the one object between the runtime and the compiler.

Built once at start-up from the loaded model, the ``ResolvedCompileConfig`` and a ``KernelSet``; the
runtime then only writes steps into ``inputs`` and calls ``run``::

    runtime                                   CompiledModel
    ───────                                   ─────────────
    CompiledModel(model, config, kernels,  ─> build the forward (eager | stock | kiln: capture,
                  limits, max_model_len)       passes with the KernelSet's ops, split, Inductor)
                                               and the persistent InputBuffers; a background
                                               build: kiln's forward on a thread, eager until then
    set_verify_shape(VerifyShape)          ─> (speculative decoding) full graphs for k + 1 tokens a request
    bind_kv_caches(kv_caches, kv_scales)   ─> the caches (and FP8 scales) every forward context carries
    capture_graphs(max_size)               ─> full / piecewise CUDA graphs, as compile.cudagraph asks
                                               (all sizes, or those up to max_size: lazy capture;
                                               none yet while a background build runs)
    start_build()                          ─> (background) the build's thread starts
    capture_next()                         ─> (lazy) one more size, between steps, until none is pending
    per step:
      InputBatch writes the step into
      compiled.inputs' host mirrors
      run(ModelInputs)                     ─> (background build done: switch to kiln's forward)
                                               dispatch (FULL | PIECEWISE | NONE), padding to the
                                               capture size, upload, forward context, forward or
                                               replay ─> ModelOutputs (hidden; logits for FULL)
      compute_logits(hidden)               ─> the sampled rows' logits, where the step had none

A background build captures and compiles, or loads from the compile cache, on a thread while
steps run the model eagerly; the step after it is done switches to it (``start_build`` starts it:
the runner calls it as the weights load on a first CUDA start, else once ready). On CUDA, graphs
wait for it: ``capture_graphs`` only plans, and the first ``capture_next`` after the switch makes
the graph sets over the built forward, every size pending, for lazy capture between steps. Capture
reads the model's shapes and never runs it, so the two do not touch each other's data. One thing is
shared: FX symbolic tracing (``torch.fx.Tracer.trace``, which reading a saved graph runs) patches
``nn.Module.__call__`` for the whole process, so while a build runs, a trace and any call into the
model's modules (``run``, ``compute_logits``, ``warm_up``) exclude each other (``_EAGER_OR_TRACE``),
and builds in one process run one at a time (``_ONE_BUILD``: Dynamo captures must not overlap). A
model that changes how it runs while captured (``capture_scope``) is built before start-up instead.

Rules kept here: the runtime never touches graphs, pieces or kernel choices, and no process-global
state is written (but for the trace lock above, while a background build runs): the kernels travel in the KernelSet (to the passes, the split, the forward
context and capture), so two compiled models in one process do not interfere. Caches may be
re-bound only until graphs are captured over them.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from kiln.compiler.artifact_cache import ArtifactCache
from kiln.compiler.cancel import cancellable, check_cancelled
from kiln.compiler.capture import KilnForward
from kiln.compiler.cudagraph import FullCUDAGraphs, GraphMode, piecewise_capture_sizes, wanted_graph_modes
from kiln.compiler.forward import build_forward, build_now, compile_seconds
from kiln.compiler.inputs import InputBuffers, InputLimits, ModelInputs, VerifyShape, next_capture_size
from kiln.compiler.piecewise import GraphRecorder, PiecewiseCUDAGraphs
from kiln.config import ResolvedCompileConfig
from kiln.forward_context import ForwardContext, forward_context
from kiln.models.loader import Background, quick_gil_handoff
from kiln.ops.registry import KernelSet

logger = logging.getLogger(__name__)

# How long a failed start-up waits for its background build to stop (``cancel_build``): the longest
# stretch between two of its safe points, an FX or Dynamo trace of the model, takes seconds.
CANCEL_WAIT_S = 30.0


@dataclass
class ModelOutputs:
    """What one ``run`` leaves; rows past the step's tokens (or requests, for FULL) are padding."""

    hidden: torch.Tensor  # [padded num_tokens, hidden]
    logits: Optional[torch.Tensor] = None  # [padded num_tokens, vocab] float32: FULL graphs compute every row's
    greedy_ids: Optional[torch.Tensor] = None  # [padded num_tokens] int64: logits.argmax(-1)


@dataclass(frozen=True)
class GraphMemoryEstimate:
    """What CUDA graphs of ``sizes`` will take, from a profiled capture (``profile_graph_memory``):
    the largest size's working set, which every smaller size reuses (outputs are held weakly), plus
    per size its graph objects. Extrapolated with a margin: the KV cache is sized after it."""

    sizes: tuple[int, ...]
    largest_bytes: int
    per_size_bytes: int
    num_extra_graphs: int = 0  # graphs beyond one per size (verify graphs), each costing per_size_bytes

    MARGIN = 1.25
    SLACK_BYTES = 128 * 2**20

    def bytes(self, num_sizes: Optional[int] = None) -> int:
        """The estimate for the ``num_sizes`` smallest sizes (all by default); the working set is
        taken as proportional to the largest size kept."""
        n = len(self.sizes) if num_sizes is None else num_sizes
        if n <= 0:
            return 0
        working = max(self.largest_bytes, 0) * self.sizes[n - 1] / self.sizes[-1]
        num_graphs = n - 1 + self.num_extra_graphs
        return int(self.MARGIN * (working + max(self.per_size_bytes, 0) * num_graphs) + self.SLACK_BYTES)


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


class CompiledModel:
    # guess_graph_memory, after Llama-3-8B's profile on an H200 (bf16, 81 sizes up to 4096 tokens):
    # the largest size's piece graphs took 3,308 MiB, 3.1 hidden states a token and piece, and each
    # further size 4 MiB, 0.12 MiB a graph (33 pieces, one full graph). A guess short of what the
    # graphs take leaves a first start without its smaller sizes; one beyond it, a little less KV
    # cache. Measured on that H200, guess (at 3.5 hidden states) against use: Llama-3-8B 5.47 / 3.49
    # GiB, Qwen2.5-0.5B 1.51 / 0.88, Qwen1.5-MoE-A2.7B 2.47 / 2.29; at 4.0 the MoE's is 2.71 GiB.
    GUESS_PIECE_OUTPUTS = 4.0  # hidden states a token and piece the largest size's graphs hold
    GUESS_BYTES_PER_GRAPH = 2**18

    def __init__(self, model: nn.Module, config: ResolvedCompileConfig, kernels: KernelSet, limits: InputLimits,
                 max_model_len: int, artifact_cache: Optional[ArtifactCache] = None,
                 forward_key: Optional[str] = None) -> None:
        self.model, self.config, self.kernels = model, config, kernels
        self._artifacts, self._forward_key = artifact_cache, forward_key  # note_forward once built
        self.max_model_len = max_model_len
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")

        def make_forward():
            pass_config = None
            if config.mode == "kiln":  # the passes import Inductor: only kiln mode's build imports them
                from kiln.passes.manager import PassConfig

                pass_config = PassConfig(kernels=kernels)
            return build_forward(model, config, pass_config, artifact_cache)

        self._building: Optional[BackgroundBuild] = None  # a background build, until switched to
        background = config.build == "background" and config.mode == "kiln"
        if background and getattr(model, "capture_scope", None) is not None:
            logger.info("background build: this model runs attention differently while it is "
                        "captured, so it is built now, before serving")
            background = False
        if background:
            self._building, self.forward = BackgroundBuild(make_forward, self.device), model
        else:
            self.forward = make_forward()
            with _ONE_BUILD:  # kiln: load the compiled forward from the cache, or compile it
                build_now(self.forward, self.device)
            self._note_built()
        self.inputs = InputBuffers(limits, self.device)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: Optional[list[torch.Tensor]] = None  # an FP8 cache's, one [2] tensor per layer
        self._calibrate_kv_scales = False  # the next step with a prefill sets kv_scales
        self.full_graphs: Optional[FullCUDAGraphs] = None  # uniform decode batches
        self.verify_graphs: Optional[FullCUDAGraphs] = None  # uniform verify batches (set_verify_shape)
        self.verify_shape: Optional[VerifyShape] = None
        self.piecewise_graphs: Optional[PiecewiseCUDAGraphs] = None  # any batch up to the largest size
        self._graph_pool: Optional[tuple] = None  # the one pool every graph is captured into
        self._any_pending = False  # planned sizes not captured yet (lazy capture)
        # a background build on CUDA: capture_graphs was called while building; its modes (None:
        # the config's) wait until capture_next plans the graphs over the built forward
        self._graphs_deferred = False
        self._deferred_modes: Optional[set[GraphMode]] = None
        self._wanted: list[tuple[Any, int]] = []  # (graphs, size) a batch ran without, not captured yet
        self._small_first: list[tuple[Any, int]] = []  # (graphs, size) captured next, once a build ends
        logger.info("kernels on %s: %s", kernels.device_type,
                    ", ".join(f"{op} {name}" for op, name in kernels.describe().items()))

    # ---- start-up ---------------------------------------------------------------------------------
    @property
    def building(self) -> bool:
        """Whether steps still run eagerly while kiln's forward is built (a background build)."""
        return self._building is not None

    @torch.inference_mode()
    def warm_up(self, kv_caches: Optional[list[torch.Tensor]] = None,
                kv_scales: Optional[list[torch.Tensor]] = None) -> None:
        """Run the forward, its logits and argmax over null requests (one decode, one two-token
        prefill; their K/V land in the null block), so the first launch of each kernel (Triton's JIT
        cache lookups, a library's handles) happens before serving rather than in the first step.
        The runner calls it before a background build on CUDA starts: the first eager step, sharing
        the GIL with the build's imports, spent 7.5 s there on an H200 (Triton's source hash 3.4 s
        of it), with Llama-3-8B. ``kv_caches`` (and an FP8 cache's ``kv_scales``): caches of its own
        in place of the bound ones, for a warm-up before those exist, while the weights still land
        (no value it computes is kept, and its garbage K/V stay out of the bound cache)."""
        if kv_caches is None:
            kv_caches, kv_scales = self.kv_caches, self.kv_scales
        buf = self.inputs
        for q in (1, 2):
            buf.fill_null_requests(0, 0, 1, q)
            buf.upload(q, 1)
            meta = buf.metadata(q, 1, 1 if q == 1 else 0, [q], [q])
            with self._forward_scope(ForwardContext(attn=meta, kv_caches=kv_caches), kv_scales), self._eager_calls():
                hidden = self.forward(buf.input_ids[:q], buf.positions[:q])
                self.kernels.argmax.op(self.model.compute_logits(hidden))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def start_build(self) -> None:
        """Start a background build now (the ``ModelRunner``: as the weights load on a first CUDA
        start, else once ready; the eager steps before it, such as its memory profile, do not start
        it); else ``wait_for_build`` starts it. Nothing without one."""
        if self._building is not None:
            self._building.start()

    def cancel_build(self, timeout: float = CANCEL_WAIT_S) -> None:
        """A start-up that failed after ``start_build``: stop the build and wait (at most ``timeout``
        seconds) for its thread to let go of the model and of the one-build lock."""
        building, self._building = self._building, None
        if building is not None and not building.cancel(timeout):
            logger.warning("background build: the build of kiln's forward had not stopped %.0f s after "
                           "it was cancelled; it ends on its own", timeout)

    def wait_for_build(self, timeout: Optional[float] = None) -> bool:
        """Block until a background build ends (or ``timeout`` seconds pass); the next ``run`` then
        switches to the built forward. Returns whether no build is still running."""
        return self._building is None or self._building.wait(timeout)

    def _switch_if_built(self) -> None:
        building = self._building
        if building is None or not building.done:
            return
        self._building = None
        if building.error is not None:
            logger.warning("background build: building kiln's forward failed, so the model keeps "
                           "running eagerly: %s: %s", type(building.error).__name__, building.error)
            return
        self.forward = building.forward
        self._note_built()
        logger.info("background build: kiln's forward is %s after %.1f s; steps run it from now on",
                    "loaded from the compile cache" if building.forward.cache_hit else "built",
                    building.seconds)

    def _note_built(self) -> None:
        if isinstance(self.forward, KilnForward) and self._artifacts is not None:
            self._artifacts.note_forward(self._forward_key)

    def set_verify_shape(self, shape: Optional[VerifyShape]) -> None:
        """Also capture full graphs for batches of ``shape.query_len`` tokens per request, up to
        ``shape.max_num_reqs`` requests (speculative decoding's verify steps); before capture."""
        if self.full_graphs is not None:
            raise RuntimeError("set the verify shape before capturing CUDA graphs")
        self.verify_shape = shape if shape is not None and shape.query_len > 1 else None

    def bind_kv_caches(self, kv_caches: list[torch.Tensor], kv_scales: Optional[list[torch.Tensor]] = None,
                       calibrate_kv_scales: bool = False) -> None:
        """The caches every later forward reads and writes (one tensor per layer), and an FP8
        cache's scales; ``calibrate_kv_scales``: the first step with a prefill sets those from its
        keys and values (graphs read the scale tensors, so they stay valid)."""
        if self.full_graphs is not None or self.verify_graphs is not None or self.piecewise_graphs is not None:
            raise RuntimeError("CUDA graphs are captured over the bound KV caches; they cannot be re-bound")
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self._calibrate_kv_scales = calibrate_kv_scales and kv_scales is not None

    def capture_graphs(self, record: Optional[GraphRecorder] = None,
                       modes: Optional[set[GraphMode]] = None, max_size: Optional[int] = None) -> None:
        """Capture what ``compile.cudagraph`` asks for (``modes`` overrides it) over the bound caches:
        full graphs first (the piece wrappers are not installed yet, so nothing nests), then piece
        graphs, all in one memory pool (graphs never run concurrently). ``max_size``: only sizes up
        to it (requests for full graphs, tokens for piece graphs) now; the others stay pending for
        ``capture_next``, and until then a batch runs on the next captured size up or without
        graphs. Off the GPU this captures nothing, unless ``record`` emulates piecewise capture (tests).
        While kiln's forward is built in the background nothing is captured yet: every size is
        pending, and ``capture_next`` plans the graphs over the built forward once steps run it."""
        has_pieces = isinstance(self.forward, KilnForward) or self._building is not None
        planned = modes
        if modes is None:
            modes = wanted_graph_modes(self.config.cudagraph, has_pieces) if self.device.type == "cuda" else set()
        if not modes:
            return
        if not self.kv_caches:
            raise RuntimeError("bind the KV caches before capturing CUDA graphs")
        if self._building is not None and record is None:
            self._graphs_deferred, self._deferred_modes, self._any_pending = True, planned, True
            logger.info("CUDA graphs: captured between steps once kiln's forward is built")
            return
        pool = self._graph_pool = torch.cuda.graph_pool_handle() if record is None else None

        def capture(graphs) -> None:
            sizes = graphs.pending_sizes if max_size is None else [s for s in graphs.pending_sizes if s <= max_size]
            graphs.capture(self._capture_scope, self.kv_caches, pool, sizes=sizes)

        if GraphMode.FULL in modes:
            self.full_graphs = self._full_graphs(self.config.capture_sizes)
            capture(self.full_graphs)
            if self.verify_shape is not None:
                self.verify_graphs = self._verify_graphs(self.config.capture_sizes)
                capture(self.verify_graphs)
        if GraphMode.PIECEWISE in modes:
            sizes = piecewise_capture_sizes(self.config.capture_sizes, modes)
            self.piecewise_graphs = PiecewiseCUDAGraphs(self.forward, self.inputs, sizes, record)
            capture(self.piecewise_graphs)
        self._any_pending = self.num_pending_captures > 0

    @property
    def num_pending_captures(self) -> int:
        """Sizes (of any kind of graph) planned and not captured yet; before graphs over a
        background build's forward are planned, 0 (``has_pending_captures`` is still true)."""
        return sum(len(g.pending_sizes) for g in self._graph_sets())

    @property
    def has_pending_captures(self) -> bool:
        return self._graphs_deferred or self.num_pending_captures > 0

    @property
    def has_wanted_captures(self) -> bool:
        """Whether a batch ran without the graph it would replay were every size captured, or a
        background build has ended and the graphs over its forward wait to be planned."""
        building = self._building
        return bool(self._wanted) or (self._graphs_deferred and (building is None or building.done))

    def capture_next(self) -> Optional[int]:
        """Capture one pending size: first one a batch asked for (``has_wanted_captures``), then (once
        a background build ends) those up to ``config.startup_capture_max``, smallest first, else the
        largest pending full-graph size, then verify graphs', then piece graphs' (largest first, as
        in one capture call, so a size reuses the larger one's memory). Only between steps, with
        none in flight: capture rewrites the input buffers and overwrites graph outputs in the pool.
        Returns the size, or None when none was captured: nothing is pending, or graphs wait for a
        background build (while it runs nothing happens; the call after it ends switches to the built
        forward and plans the graphs, all of them pending)."""
        if self._graphs_deferred:
            self._switch_if_built()  # between steps: the same switch the next run() would make
            if self._building is not None:
                return None
            self._graphs_deferred, modes = False, self._deferred_modes
            if modes is not None and not isinstance(self.forward, KilnForward):  # the build failed
                modes = modes - {GraphMode.PIECEWISE}
            self.capture_graphs(modes=modes, max_size=0)
            # First the sizes a start that captures before ready takes (the first requests' decodes),
            # smallest first; then the rest, largest first.
            small = self.config.startup_capture_max
            self._small_first = [(g, s) for g in self._graph_sets() for s in sorted(g.pending_sizes) if s <= small]
            return None
        nxt = self._next_capture()
        if nxt is None:
            self._any_pending = False
            return None
        graphs, size = nxt
        graphs.capture(self._capture_scope, self.kv_caches, self._graph_pool, log=False, sizes=[size])
        self._any_pending = self.num_pending_captures > 0
        return size

    def _next_capture(self) -> Optional[tuple[Any, int]]:
        for queue in (self._wanted, self._small_first):
            while queue:
                graphs, size = queue.pop(0)
                if size in graphs.pending_sizes:
                    return graphs, size
        graphs = next((g for g in self._graph_sets() if g.pending_sizes), None)
        return (graphs, graphs.pending_sizes[-1]) if graphs is not None else None

    def drop_pending_captures(self) -> None:
        """Capture no more sizes: the pending ones stay without graphs, and batches stop noting them."""
        self._any_pending = self._graphs_deferred = False
        self._wanted.clear()
        self._small_first.clear()

    def _want_graph(self, num_tokens: int, num_reqs: int, num_decodes: int, mode: GraphMode, padded: int) -> None:
        """Lazy capture, after dispatch: note the size this batch would replay were every planned size
        captured, when it is not (the batch ran on a larger size or without graphs)."""
        full, pieces = self.full_graphs, self.piecewise_graphs
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

    def _graph_sets(self) -> list:
        return [g for g in (self.full_graphs, self.verify_graphs, self.piecewise_graphs) if g is not None]

    def _verify_graphs(self, capture_sizes) -> FullCUDAGraphs:
        shape = self.verify_shape
        return self._full_graphs(capture_sizes, query_len=shape.query_len, max_num_reqs=shape.max_num_reqs)

    def _full_graphs(self, capture_sizes, **kwargs) -> FullCUDAGraphs:
        """Whole-forward graphs ending in the logits and their argmax (the KernelSet's)."""
        return FullCUDAGraphs(self.forward, self.inputs, capture_sizes, compute_logits=self.model.compute_logits,
                              argmax=self.kernels.argmax.op, **kwargs)

    @torch.inference_mode()
    def profile_graph_memory(self, kv_caches: list[torch.Tensor]) -> Optional["GraphMemoryEstimate"]:
        """Measure what the CUDA graphs ``compile.cudagraph`` asks for will take, before the KV
        cache is sized: capture the largest size (its working set), then the smallest into the same
        pool (what each further size adds: the graph objects), over ``kv_caches`` (a small temporary
        cache), and free both. None when no graphs are captured."""
        if self.device.type != "cuda":
            return None
        modes = wanted_graph_modes(self.config.cudagraph, isinstance(self.forward, KilnForward))
        sizes = self._graph_sizes(modes)
        if not sizes:
            return None
        self.bind_kv_caches(kv_caches)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free = [torch.cuda.mem_get_info()[0]]
        pool = torch.cuda.graph_pool_handle()
        probes: list = []
        for probe in (sizes[-1], sizes[0]):  # largest first: the smallest then reuses its memory
            if GraphMode.FULL in modes:
                full = self._full_graphs((probe,))
                full.capture(self._capture_scope, self.kv_caches, pool, log=False)
                probes.append(full)
            if GraphMode.PIECEWISE in modes:
                pieces = PiecewiseCUDAGraphs(self.forward, self.inputs, (probe,))
                pieces.capture(self._capture_scope, self.kv_caches, pool, log=False)
                probes.append(pieces)
                pieces.release()  # takes its wrappers out of the forward; its graphs live on in `probes`
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # only the graphs' memory counts, not the warm-up's cached blocks
            free.append(torch.cuda.mem_get_info()[0])
        del probes, pool
        full = pieces = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.kv_caches = []
        # Verify graphs share the pool and add their graph objects; the working set is taken as
        # proportional to the most tokens any graph runs (a verify graph of n requests runs n (k + 1)).
        largest_bytes, num_verify = free[0] - free[1], 0
        if GraphMode.FULL in modes and self.verify_shape is not None:
            verify_sizes = self._verify_graphs(sizes).sizes
            num_verify = len(verify_sizes)
            most_tokens = max(verify_sizes, default=0) * self.verify_shape.query_len
            largest_bytes = int(largest_bytes * max(1.0, most_tokens / sizes[-1]))
        estimate = GraphMemoryEstimate(tuple(sizes), largest_bytes=largest_bytes, per_size_bytes=free[1] - free[2],
                                       num_extra_graphs=num_verify)
        logger.info("CUDA graphs profiled: largest size %d takes %.0f MiB, each further size %.1f MiB -> "
                    "%.2f GiB kept for %d sizes", sizes[-1], estimate.largest_bytes / 2**20,
                    estimate.per_size_bytes / 2**20, estimate.bytes() / 2**30, len(sizes))
        return estimate

    def guess_graph_memory(self, activation_bytes: int, max_num_tokens: int, num_pieces: int,
                           hidden_bytes: int) -> Optional["GraphMemoryEstimate"]:
        """What the CUDA graphs of kiln's forward will take, guessed while a background build has no
        forward to profile yet (a first start). The largest size's working set: with piece graphs,
        ``GUESS_PIECE_OUTPUTS`` hidden states (``hidden_bytes`` each) a token for each of
        ``num_pieces`` pieces; else the step's peak activations scaled to its tokens. Per further
        size, ``GUESS_BYTES_PER_GRAPH`` for each graph captured at it. The runner keeps what capture
        then takes for the next start. None when no graphs are captured."""
        if self.device.type != "cuda":
            return None
        modes = wanted_graph_modes(self.config.cudagraph, True)
        sizes = self._graph_sizes(modes)
        if not sizes:
            return None
        if GraphMode.PIECEWISE in modes:
            working = int(self.GUESS_PIECE_OUTPUTS * num_pieces * sizes[-1] * hidden_bytes)
        else:
            working = activation_bytes * sizes[-1] // max(max_num_tokens, 1)
        graphs_per_size = (num_pieces if GraphMode.PIECEWISE in modes else 0) + (GraphMode.FULL in modes)
        num_verify = len(self._verify_graphs(sizes).sizes) if GraphMode.FULL in modes and self.verify_shape else 0
        estimate = GraphMemoryEstimate(tuple(sizes), largest_bytes=working,
                                       per_size_bytes=graphs_per_size * self.GUESS_BYTES_PER_GRAPH,
                                       num_extra_graphs=num_verify)
        logger.info("CUDA graphs: %.2f GiB kept for %d sizes, a guess (%d graphs a size) until kiln's forward "
                    "is built; what they take is kept for the next start", estimate.bytes() / 2**30, len(sizes),
                    graphs_per_size)
        return estimate

    def _graph_sizes(self, modes: set[GraphMode]) -> list[int]:
        """Every size some graph of ``modes`` is captured at (the union of full and piecewise sizes)."""
        buf, sizes = self.inputs, set()
        if GraphMode.FULL in modes:
            sizes |= {s for s in self.config.capture_sizes if s <= min(buf.max_num_reqs, buf.max_num_tokens)}
        if GraphMode.PIECEWISE in modes:
            sizes |= {s for s in piecewise_capture_sizes(self.config.capture_sizes, modes) if s <= buf.max_num_tokens}
        return sorted(sizes)

    @property
    def graph_capture_seconds(self) -> float:
        return sum(g.capture_seconds for g in (self.full_graphs, self.verify_graphs, self.piecewise_graphs) if g)

    @property
    def graph_memory_bytes(self) -> int:
        return sum(g.memory_bytes for g in (self.full_graphs, self.verify_graphs, self.piecewise_graphs) if g)

    def startup_seconds(self) -> dict[str, float]:
        """Compile time by phase (0 for a phase that did not run, or that runs in the background) and
        CUDA-graph capture time."""
        return {**compile_seconds(self.forward), "cudagraph_s": self.graph_capture_seconds}

    # ---- one step ---------------------------------------------------------------------------------
    def run(self, inputs: ModelInputs) -> ModelOutputs:
        """Run the step the host mirrors of ``self.inputs`` hold, described by ``inputs``.

        Pads it to the capture size its graph was captured at (FULL: null decode requests;
        PIECEWISE: null token rows, attention still sees only the real ones), uploads it, and
        replays or runs the forward inside the step's forward context."""
        if self._building is not None:
            self._switch_if_built()
        buf, n, num_reqs = self.inputs, inputs.num_tokens, inputs.num_reqs
        q = inputs.uniform_query_len
        mode, padded = dispatch(self.full_graphs, self.piecewise_graphs, n, num_reqs, inputs.num_decodes,
                                self.verify_graphs, q)
        if inputs.mm_embeds is not None:
            mode, padded = GraphMode.NONE, n
        if self._any_pending:
            self._want_graph(n, num_reqs, inputs.num_decodes, mode, padded)
        if mode is GraphMode.FULL:
            graphs = self.full_graphs if inputs.num_decodes == num_reqs and q == 1 else self.verify_graphs
            size = padded // graphs.query_len  # requests
            buf.fill_null_requests(num_reqs, n, size, graphs.query_len)
            buf.upload(padded, size)
            buf.set_device_input_ids(inputs.device_input_ids)
            out = graphs.replay(size)
            return ModelOutputs(out.hidden, out.logits, out.greedy_ids)
        buf.pad_tokens(n, padded)
        buf.upload(padded, num_reqs)
        buf.set_device_input_ids(inputs.device_input_ids)
        meta = buf.metadata(n, num_reqs, inputs.num_decodes, inputs.query_lens, inputs.seq_lens)
        graphs = (self.piecewise_graphs.replaying(padded, n) if mode is GraphMode.PIECEWISE
                  else contextlib.nullcontext())
        ctx = ForwardContext(attn=meta, kv_caches=self.kv_caches, mm_embeds=inputs.mm_embeds)
        if self._calibrate_kv_scales and inputs.num_decodes < num_reqs:  # real prompt tokens, never a capture's
            ctx.calibrate_kv_scales, self._calibrate_kv_scales = True, False
        with self._forward_scope(ctx), graphs, self._eager_calls():
            hidden = self.forward(buf.input_ids[:padded], buf.positions[:padded])  # [padded, hidden]
        return ModelOutputs(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's ``compute_logits`` (``[N, hidden] -> [N, vocab]`` float32), for the rows of a
        step that ran without a full graph (a full graph computes them inside). The runtime calls this
        one, not the model's: see ``_eager_calls``."""
        with self._eager_calls():
            return self.model.compute_logits(hidden)

    def _eager_calls(self) -> contextlib.AbstractContextManager:
        """Held around every call into the model's modules while a background build runs: an FX trace
        on the build's thread patches ``nn.Module.__call__`` for the whole process, and would take in
        an eager forward or logits head on another thread (``_EAGER_OR_TRACE``). On CUDA the build's
        Python also waits meanwhile (``StepGate``)."""
        building = self._building
        if building is None:
            return contextlib.nullcontext()
        if building.gate is None:
            return _EAGER_OR_TRACE
        stack = contextlib.ExitStack()
        stack.enter_context(_EAGER_OR_TRACE)  # first: a trace holding it ends before the gate closes
        stack.enter_context(building.gate.step())
        return stack

    @contextlib.contextmanager
    def _forward_scope(self, ctx: ForwardContext, kv_scales: Optional[list[torch.Tensor]] = None) -> Iterator[None]:
        ctx.attention_impl = self.kernels.attention.impl
        ctx.kv_scales = self.kv_scales if kv_scales is None else kv_scales
        ctx.lora_slots = self.inputs.lora_slots
        with forward_context(ctx), self.kernels.attention.forward_scope(ctx):
            yield

    @contextlib.contextmanager
    def _capture_scope(self, ctx: ForwardContext) -> Iterator[None]:
        with self._forward_scope(ctx), self.kernels.attention.graph_capture(self.max_model_len):
            yield


# Held by an eager forward during a background build, and by every FX symbolic trace meanwhile.
_EAGER_OR_TRACE = threading.RLock()
# Held by every build, at start-up or in the background: one Dynamo capture at a time in a process.
_ONE_BUILD = threading.Lock()


@contextlib.contextmanager
def _traces_exclude_eager_forwards() -> Iterator[None]:
    """For the length of a build: ``torch.fx.Tracer.trace`` takes ``_EAGER_OR_TRACE``, since it
    patches ``nn.Module.__call__`` process-wide and an eager forward on another thread would be traced."""
    original = torch.fx.Tracer.trace

    def trace(self, *args, **kwargs):
        check_cancelled()
        with _EAGER_OR_TRACE:
            return original(self, *args, **kwargs)

    torch.fx.Tracer.trace = trace
    try:
        yield
    finally:
        torch.fx.Tracer.trace = original


class StepGate:
    """Keeps a CUDA background build's Python out of the eager steps' way. The build's thread runs
    under ``sys.setprofile(hook)``; at each Python call it makes while a step runs (``step()``, taken
    by ``_eager_calls``) it waits, the GIL released, until the step ends. Without it each torch op of
    an eager step, having released the GIL, waited to get it back from the build's imports and
    tracing. It cannot stop C calls that hold the GIL (module loads, unmarshal). After ``MAX_PARK_S``
    parked the build runs for ``PASS_S`` regardless, so that steps back to back still let it end.

    On an H200, Llama-3-8B from an on-disk checkpoint (benchmarks/results/startup-H200.md#startup-build-gate): the
    first token of a warm start came at 6.86 s against 9.32 s without it (the first eager step beside
    the build took 0.10 s against 1.84 s), and of a first start at 18.3 s against 26.7 s (the memory
    profile and warm-up ran beside the build). The hook slows the build's Python: kiln's forward
    arrived 1.0-1.1 s later on both starts. ``KILN_BUILD_GATE=0`` turns it off."""

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

    def __init__(self, make_forward: Callable[[], KilnForward], device: torch.device) -> None:
        self.forward: Optional[KilnForward] = None  # once built
        self.seconds = 0.0
        self._make_forward, self._device = make_forward, device
        self._task: Optional[Background] = None
        self._start_lock = threading.Lock()
        self._cancel = threading.Event()
        # CUDA only: on the CPU the steps hold the cores in long ops, and a parked build would mostly wait.
        self.gate = StepGate() if device.type == "cuda" and os.environ.get("KILN_BUILD_GATE") != "0" else None

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
            with cancellable(self._cancel), handoff, _ONE_BUILD, _traces_exclude_eager_forwards():
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
