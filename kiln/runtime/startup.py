"""The model runner's start-up: its phases' one timing table, and the phases that plan its memory.

``ModelRunner.__init__`` runs start-up as a list of phases and times each with a ``StartupClock``;
``PHASES`` is the one table of them: the key each is kept under in ``ModelRunner.startup_seconds``,
its name in the ready line (``runner_timeline``, which ``StartupReport`` shows) and in the runner's
own start-up log line (``log_startup``)::

    key               ready line            log line
    load_weights_s    load weights (*)      load weights
    dynamo_s          Dynamo                Dynamo                 (the CompiledModel's build)
    inductor_s        Inductor              Inductor
    cache_load_s      compile cache load    compile cache load
    cudagraph_s       CUDA graphs           CUDA graphs
    profile_s         memory profile        memory profile
    kv_alloc_s        KV cache              KV allocation
    tokenizer_wait_s  tokenizer wait        tokenizer wait
    eager_warm_up_s   eager warm-up         eager warm-up          (logged when it ran)

    (*) the ready line counts time on the start's own thread only: building the model
        (load_call_s) and waiting for the read (weights_wait_s); the rest of the read ran on
        threads beside the other phases, so the ready line's phases do not overlap.

The phases of the memory plan live here too: the eager warm-up (``warm_up``) and the memory
profile (``MemoryProfiler``: peak activations and CUDA-graph memory, profiled, read from a warm
start's cache, or on a first background start the eager forward's and a guess, kept as measured
once lazy capture ends). Sizing and allocating the KV cache is ``kiln.runtime.kv_sizing``'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping, Optional

import torch

from kiln.compiler import CompiledModel, GraphMemoryEstimate
from kiln.config import SchedulerConfig
from kiln.runtime import kv_sizing
from kiln.runtime.kv_sizing import KVShape

if TYPE_CHECKING:
    from kiln.runtime.draft_proposer import DraftProposer

logger = logging.getLogger(__name__)

# Blocks of the scratch KV cache that an eager warm-up before the weights have landed writes its
# null requests' K/V to (block 0 only): more than 1, so that no kernel is specialised on a
# one-block cache that no step has.
WARM_UP_BLOCKS = 16


@dataclass(frozen=True)
class Phase:
    key: str  # in ModelRunner.startup_seconds
    name: str  # in the ready line
    log_name: str  # in the runner's start-up log line
    ready_keys: tuple[str, ...] = ()  # what the ready line sums for it (default: key)


PHASES = (
    Phase("load_weights_s", "load weights", "load weights", ready_keys=("load_call_s", "weights_wait_s")),
    Phase("dynamo_s", "Dynamo", "Dynamo"),
    Phase("inductor_s", "Inductor", "Inductor"),
    Phase("cache_load_s", "compile cache load", "compile cache load"),
    Phase("cudagraph_s", "CUDA graphs", "CUDA graphs"),
    Phase("profile_s", "memory profile", "memory profile"),
    Phase("kv_alloc_s", "KV cache", "KV allocation"),
    Phase("tokenizer_wait_s", "tokenizer wait", "tokenizer wait"),
    Phase("eager_warm_up_s", "eager warm-up", "eager warm-up"),
)
# Kept beside the phases: the parts of load_weights_s on the start's own thread, and the total.
PARTS = ("load_call_s", "weights_wait_s")


class StartupClock:
    """Seconds per start-up phase of one runner (``PHASES`` keys and ``PARTS``), on the start's own
    thread, from when it was made; a phase timed twice adds up."""

    def __init__(self) -> None:
        self._t_start = time.perf_counter()
        self._seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - t0)

    def add(self, key: str, seconds: float) -> None:
        self._seconds[key] = self._seconds.get(key, 0.0) + seconds

    def get(self, key: str) -> float:
        return self._seconds.get(key, 0.0)

    def finish(self, compiled: Mapping[str, float]) -> dict[str, float]:
        """``ModelRunner.startup_seconds``: every phase (the ``CompiledModel``'s from ``compiled``),
        the parts, and ``ready_s``, the seconds since this clock was made."""
        seconds = {"load_weights_s": self.get("load_weights_s"), **{k: self.get(k) for k in PARTS}, **compiled}
        seconds.update({p.key: self.get(p.key) for p in PHASES if p.key not in seconds})
        seconds["ready_s"] = time.perf_counter() - self._t_start
        return seconds


def runner_timeline(phases_s: Mapping[str, float], startup_s: float) -> list[tuple[str, float]]:
    """The ready line's rows for a runner's ``startup_seconds`` over ``startup_s`` seconds of
    building the engine: one per phase, then what no phase accounts for."""
    rows = [(p.name, sum(phases_s.get(k, 0.0) for k in p.ready_keys or (p.key,))) for p in PHASES]
    return rows + [("other", max(0.0, startup_s - sum(s for _, s in rows)))]


def log_startup(seconds: Mapping[str, float], overlap: str = "") -> None:
    """The runner's start-up line: every phase (the eager warm-up only when it ran), ``overlap``
    after the weights (how their read ran beside the rest), and when it was ready."""
    shown = []
    for p in PHASES:
        s = seconds.get(p.key, 0.0)
        if p.key == "eager_warm_up_s" and not s:
            continue
        shown.append(f"{p.log_name} {s:.2f} s{overlap if p.key == 'load_weights_s' else ''}")
    logger.info("start-up: %s; ready in %.2f s", ", ".join(shown), seconds["ready_s"])


def warm_up(compiled: CompiledModel, kv_shape: KVShape, device: torch.device, scratch: bool = False) -> None:
    """``CompiledModel.warm_up``; ``scratch``: over a KV cache of its own on ``device`` (the bound
    one does not exist yet)."""
    if scratch:
        compiled.warm_up(kv_sizing.allocate_kv_caches(kv_shape, WARM_UP_BLOCKS, device),
                         kv_sizing.allocate_kv_scales(kv_shape, {}, device))
    else:
        compiled.warm_up()


class MemoryProfiler:
    """The memory profile of a CUDA start: the largest step's peak activations, and what the CUDA
    graphs will take when the KV cache is sized from the free memory (``want_graphs``). ``cache``:
    where the profile of this forward and shape is kept (None: not kept); ``kept``: what it held."""

    def __init__(self, cache: Optional[kv_sizing.MemoryProfileCache], kv_shape: KVShape, device: torch.device,
                 max_model_len: int, sched: SchedulerConfig, want_graphs: bool) -> None:
        self.cache, self.kv_shape, self.device, self.max_model_len = cache, kv_shape, device, max_model_len
        self.sched, self.want_graphs = sched, want_graphs
        self.kept: Optional[kv_sizing.MemoryProfile] = cache.load() if cache is not None else None
        # A first background start's eager activation bytes, kept with the graphs' memory once measured.
        self.unmeasured_bytes: Optional[int] = None

    def profile(self, compiled: CompiledModel, draft: Optional[DraftProposer], num_pieces: int,
                hidden_bytes: int) -> tuple[int, Optional[GraphMemoryEstimate]]:
        """Peak activation bytes and the graphs' estimate: read from a warm start's cache, or
        profiled. A first start that serves eagerly while kiln's forward is built profiles the eager
        forward's activations and guesses the graphs (``num_pieces`` pieces of ``hidden_bytes`` a
        token; ``CompiledModel.guess_graph_memory``); what capture then takes is kept for the next
        start (``keep_measured``). ``draft``: a draft model, whose step runs before the target's."""
        cached, sched = self.kept, self.sched
        if cached is not None:
            logger.info("memory profile from the cache: peak activations %.2f GiB, CUDA graphs %.2f GiB",
                        cached.activation_bytes / 2**30, cached.graphs.bytes() / 2**30 if cached.graphs else 0.0)
            return cached.activation_bytes, cached.graphs
        building = compiled.building  # a first start serving eagerly: no built forward to measure
        if building:
            logger.info("background build: no memory profile of kiln's forward is kept yet (a first "
                        "start): the KV cache is sized after the eager forward and a guess of the CUDA "
                        "graphs; what they take is kept for later starts")
        activation_bytes = kv_sizing.profile_activation_bytes(  # building: the eager forward's peak
            compiled, self.kv_shape, self.max_model_len, sched.max_num_batched_tokens, sched.max_num_seqs)
        if draft is not None:  # runs before the target's forward, never beside it
            activation_bytes = max(activation_bytes, kv_sizing.profile_activation_bytes(
                draft.compiled, draft.kv_shape, self.max_model_len, draft.compiled.inputs.max_num_tokens,
                sched.max_num_seqs))
        if building:  # should the graphs outgrow the guess, lazy capture stops there (capture_pending)
            graphs = (compiled.guess_graph_memory(activation_bytes, sched.max_num_batched_tokens, num_pieces,
                                                  hidden_bytes) if self.want_graphs else None)
            self.unmeasured_bytes = activation_bytes if self.cache is not None else None
            return activation_bytes, graphs
        graphs = None
        if self.want_graphs:
            graphs = compiled.profile_graph_memory(kv_sizing.allocate_kv_caches(self.kv_shape, 2, self.device))
        if self.cache is not None:
            self.cache.store(kv_sizing.MemoryProfile(activation_bytes, graphs))
        return activation_bytes, graphs

    def keep_measured(self, estimate: Optional[GraphMemoryEstimate], compiled: CompiledModel) -> None:
        """Once a first start's lazy capture ends, keep a memory profile for the next start: the
        eager activations it was sized with, and the graphs' memory as measured, per size captured
        (should capture have stopped at ``estimate``, the guess, the largest sizes: an
        over-estimate of the rest). Once only."""
        if self.unmeasured_bytes is None or estimate is None:
            return
        activation_bytes, self.unmeasured_bytes = self.unmeasured_bytes, None
        sizes = estimate.sizes
        num_captured = max(1, len(sizes) - compiled.num_pending_captures)
        per_size = compiled.graph_memory_bytes // num_captured
        measured = GraphMemoryEstimate(sizes, largest_bytes=per_size, per_size_bytes=per_size,
                                       num_extra_graphs=estimate.num_extra_graphs)
        self.cache.store(kv_sizing.MemoryProfile(activation_bytes, measured))
