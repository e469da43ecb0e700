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

It owns the forward and the switch to a background build's (``kiln.compiler.background_build``:
kiln's forward built on a thread while steps run the model eagerly; the step after it is done
switches to it; ``start_build`` starts it: the runner calls it as the weights load on a first CUDA
start, else once ready), the bound caches and the step's forward context. It delegates the CUDA
graphs to ``GraphSets`` (``kiln.compiler.graph_sets``: planning, lazy capture, dispatch) and their
memory estimate to ``kiln.compiler.graph_memory``. On CUDA, graphs wait for a background build:
``capture_graphs`` only plans, and the first ``capture_next`` after the switch makes the graph sets
over the built forward, every size pending, for lazy capture between steps. While a build runs,
every call into the model's modules (``run``, ``compute_logits``, ``warm_up``) is made under
``background_build.eager_calls``. A model that changes how it runs while captured
(``capture_scope``) is built before start-up instead.

Rules kept here: the runtime never touches graphs, pieces or kernel choices, and no process-global
state is written (but for the background build's trace lock): the kernels travel in the KernelSet
(to the passes, the split, the forward context and capture), so two compiled models in one process
do not interfere. Caches may be re-bound only until graphs are captured over them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from kiln.compiler import graph_memory
from kiln.compiler.artifact_cache import ArtifactCache
from kiln.compiler.background_build import CANCEL_WAIT_S, ONE_BUILD, BackgroundBuild, eager_calls
from kiln.compiler.capture import KilnForward
from kiln.compiler.cudagraph import FullCUDAGraphs, GraphMode
from kiln.compiler.forward import build_forward, build_now, compile_seconds
from kiln.compiler.graph_memory import GraphMemoryEstimate
from kiln.compiler.graph_sets import GraphSets
from kiln.compiler.inputs import InputBuffers, InputLimits, ModelInputs, VerifyShape
from kiln.compiler.piecewise import GraphRecorder, PiecewiseCUDAGraphs
from kiln.config import ResolvedCompileConfig
from kiln.forward_context import ForwardContext, forward_context
from kiln.ops.registry import KernelSet

logger = logging.getLogger(__name__)


@dataclass
class ModelOutputs:
    """What one ``run`` leaves; rows past the step's tokens (or requests, for FULL) are padding."""

    hidden: torch.Tensor  # [padded num_tokens, hidden]
    logits: Optional[torch.Tensor] = None  # [padded num_tokens, vocab] float32: FULL graphs compute every row's
    greedy_ids: Optional[torch.Tensor] = None  # [padded num_tokens] int64: logits.argmax(-1)


class CompiledModel:
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
            self._building, self.forward = BackgroundBuild(make_forward, self.device, config.build_gate), model
        else:
            self.forward = make_forward()
            with ONE_BUILD:  # kiln: load the compiled forward from the cache, or compile it
                build_now(self.forward, self.device)
            self._note_built()
        self.inputs = InputBuffers(limits, self.device)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: Optional[list[torch.Tensor]] = None  # an FP8 cache's, one [2] tensor per layer
        self._calibrate_kv_scales = False  # the next step with a prefill sets kv_scales
        self.graphs = GraphSets(config, self.inputs, self.device, model.compute_logits, kernels.argmax.op,
                                self._capture_scope)
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
        self.graphs.set_verify_shape(shape)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor], kv_scales: Optional[list[torch.Tensor]] = None,
                       calibrate_kv_scales: bool = False) -> None:
        """The caches every later forward reads and writes (one tensor per layer), and an FP8
        cache's scales; ``calibrate_kv_scales``: the first step with a prefill sets those from its
        keys and values (graphs read the scale tensors, so they stay valid)."""
        if self.graphs.sets():
            raise RuntimeError("CUDA graphs are captured over the bound KV caches; they cannot be re-bound")
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self._calibrate_kv_scales = calibrate_kv_scales and kv_scales is not None

    # ---- CUDA graphs (kiln.compiler.graph_sets, graph_memory) --------------------------------------
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
        self.graphs.capture(self.forward, self.kv_caches, self._building is not None, record, modes, max_size)

    @property
    def num_pending_captures(self) -> int:
        """Sizes (of any kind of graph) planned and not captured yet; before graphs over a
        background build's forward are planned, 0 (``has_pending_captures`` is still true)."""
        return self.graphs.num_pending

    @property
    def has_pending_captures(self) -> bool:
        return self.graphs.has_pending

    @property
    def has_wanted_captures(self) -> bool:
        """Whether a batch ran without the graph it would replay were every size captured, or a
        background build has ended and the graphs over its forward wait to be planned."""
        building = self._building
        return self.graphs.has_wanted(building is None or building.done)

    def capture_next(self) -> Optional[int]:
        """Capture one pending size: first one a batch asked for (``has_wanted_captures``), then (once
        a background build ends) those up to ``config.startup_capture_max``, smallest first, else the
        largest pending full-graph size, then verify graphs', then piece graphs' (largest first, as
        in one capture call, so a size reuses the larger one's memory). Only between steps, with
        none in flight: capture rewrites the input buffers and overwrites graph outputs in the pool.
        Returns the size, or None when none was captured: nothing is pending, or graphs wait for a
        background build (while it runs nothing happens; the call after it ends switches to the built
        forward and plans the graphs, all of them pending)."""
        if self.graphs.deferred:
            self._switch_if_built()  # between steps: the same switch the next run() would make
            if self._building is None:
                self.graphs.plan_deferred(self.forward, self.kv_caches)
            return None
        return self.graphs.capture_next(self.kv_caches)

    def drop_pending_captures(self) -> None:
        """Capture no more sizes: the pending ones stay without graphs, and batches stop noting them."""
        self.graphs.drop_pending()

    def profile_graph_memory(self, kv_caches: list[torch.Tensor]) -> Optional[GraphMemoryEstimate]:
        """What the CUDA graphs will take, measured over ``kv_caches`` (a small temporary cache) before
        the KV cache is sized (``graph_memory.profile_graph_memory``); None when none are captured."""
        return graph_memory.profile_graph_memory(self.graphs, self.forward, kv_caches)

    def guess_graph_memory(self, activation_bytes: int, max_num_tokens: int, num_pieces: int,
                           hidden_bytes: int) -> Optional[GraphMemoryEstimate]:
        """What the CUDA graphs of kiln's forward will take, guessed while a background build runs
        (``graph_memory.guess_graph_memory``); None when none are captured."""
        return graph_memory.guess_graph_memory(self.graphs, self.forward, activation_bytes, max_num_tokens,
                                               num_pieces, hidden_bytes)

    @property
    def full_graphs(self) -> Optional[FullCUDAGraphs]:
        return self.graphs.full

    @full_graphs.setter
    def full_graphs(self, graphs: Optional[FullCUDAGraphs]) -> None:  # None: dispatch without them (tests)
        self.graphs.full = graphs

    @property
    def verify_graphs(self) -> Optional[FullCUDAGraphs]:
        return self.graphs.verify

    @verify_graphs.setter
    def verify_graphs(self, graphs: Optional[FullCUDAGraphs]) -> None:
        self.graphs.verify = graphs

    @property
    def piecewise_graphs(self) -> Optional[PiecewiseCUDAGraphs]:
        return self.graphs.piecewise

    @piecewise_graphs.setter
    def piecewise_graphs(self, graphs: Optional[PiecewiseCUDAGraphs]) -> None:
        self.graphs.piecewise = graphs

    @property
    def verify_shape(self) -> Optional[VerifyShape]:
        return self.graphs.verify_shape

    @property
    def graph_capture_seconds(self) -> float:
        return self.graphs.capture_seconds

    @property
    def graph_memory_bytes(self) -> int:
        return self.graphs.memory_bytes

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
        mode, padded = self.graphs.route(inputs)
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
        """Held around every call into the model's modules (``background_build.eager_calls``)."""
        return eager_calls(self._building)

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
