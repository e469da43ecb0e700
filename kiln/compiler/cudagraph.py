"""Full CUDA graphs: the whole forward captured once per capture size, for uniform decode batches.

What this module owns:

- ``FullCUDAGraphs``: ``compile.cudagraph=full``: the whole forward, attention included, captured
  once per capture size for uniform batches of ``query_len`` tokens per request (decodes: 1;
  speculative verification of k proposed tokens: k + 1), with the logits of every row and their
  argmax (every row samples). A batch of ``n`` requests replays the graph of the next capture
  size ``>= n`` (``size * query_len`` tokens); the padded requests read and write only the null
  block 0 (tokens 0, positions 0..query_len-1, slot 0, seq_len query_len), which the block pool
  never hands out, so they cannot touch a real request's cache.

- ``GraphMode`` and ``wanted_graph_modes``: the kinds of graph ``compile.cudagraph`` asks for.
  ``piecewise`` graphs (the pieces between attention ops, ``compile.mode=kiln`` only) live in
  ``kiln.compiler.piecewise``; which one a batch replays is ``kiln.compiler.graph_sets.dispatch``.

Rules kept here: captures happen at start-up, or (lazy capture (``compile.startup`` auto or fast)) between engine steps,
never while a step is in flight; a batch only ever replays a captured size (``padded_size`` looks
at ``captured_sizes``), so sizes not captured yet run on the next captured size up or without
graphs; all graphs share one memory pool and each call captures from the largest size down, so
smaller graphs reuse the larger one's blocks; capture runs inside the attention kernel's
``graph_capture(max_model_len)`` context (for the Triton decode kernel: split counts that do not
depend on the capture batch's context lengths).
Padding only ever reads and writes the null block. Graphs are recorded with ``graph_capture``
(``torch.cuda.graph`` without its per-graph device sync and cache flush); capture loops synchronize
before rewriting host buffers and flush the allocator's cache once at the end.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from kiln.compiler.inputs import InputBuffers, next_capture_size
from kiln.forward_context import ForwardContext
from kiln.ops.sampling import argmax_reference

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Enters the forward context of a capture batch, and whatever the kernels need around a capture.
CaptureScope = Callable[[ForwardContext], ContextManager[None]]


class GraphMode(enum.Enum):
    NONE = "none"  # run the forward as built (eager, stock or kiln pieces)
    FULL = "full"  # replay the whole-forward graph of a capture size
    PIECEWISE = "piecewise"  # replay each piece's graph of a capture size, attention eager between


def wanted_graph_modes(cudagraph: str, has_pieces: bool = True) -> set[GraphMode]:
    """Which graphs ``compile.cudagraph`` asks for. Piecewise graphs need pieces (``compile.mode=kiln``):
    without them ``piecewise`` runs without graphs and ``full_and_piecewise`` as ``full``, with a warning."""
    wanted = {"none": set(), "full": {GraphMode.FULL}, "piecewise": {GraphMode.PIECEWISE},
              "full_and_piecewise": {GraphMode.FULL, GraphMode.PIECEWISE}}[cudagraph]
    if GraphMode.PIECEWISE in wanted and not has_pieces:
        logger.warning("compile.cudagraph=%s: piecewise graphs need compile.mode=kiln (the forward split at "
                       "attention); %s", cudagraph, "mixed batches run without graphs, decode-only batches "
                       "replay full graphs" if GraphMode.FULL in wanted else "running without CUDA graphs")
        wanted.discard(GraphMode.PIECEWISE)
    return wanted


def piecewise_capture_sizes(capture_sizes: tuple[int, ...], modes: set[GraphMode]) -> tuple[int, ...]:
    """The sizes piece graphs are captured at. Alone they take every batch: all of ``capture_sizes``.
    Beside full graphs, which take every decode-only batch, they serve batches with a prefill, whose
    padded rows cost GEMM work that is nearly free while the step is bound by reading the weights
    (up to a few hundred rows) and attention never sees: sizes up to 8, powers of two up to 128,
    multiples of 64, and the largest, with the default sizes up to 512, 14 piece sets instead of 67."""
    if GraphMode.FULL not in modes or not capture_sizes:
        return tuple(capture_sizes)
    keep = {s for s in capture_sizes if s <= 8 or (s <= 128 and s & (s - 1) == 0) or s % 64 == 0}
    return tuple(sorted(keep | {max(capture_sizes)}))


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool: tuple) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` without what that does on entry: a device-wide
    ``synchronize()`` and ``empty_cache()``. kiln captures hundreds of graphs at start-up (a graph per
    piece per size), and between two piece captures the GPU still runs the previous piece's replay
    (up to milliseconds at thousands of tokens): waiting for it each time left the GPU and the host
    taking turns. Capture only records, so it needs no finished work; what it records runs on the
    current stream after everything already there. Callers synchronize before rewriting host
    buffers an earlier upload may still read, and empty the allocator's cache once captures end."""
    device = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)


def weak_ref(t: Any) -> Any:
    """A CUDA tensor viewing ``t``'s memory without keeping it allocated; anything else as is.

    Captured graphs keep their static outputs at fixed addresses of the shared graph pool. Held
    strongly, each graph's outputs would stay allocated for good (every size's logits, every piece's
    activations); held weakly, the next capture into the pool reuses that memory. Graphs never run
    concurrently and each replay rewrites its outputs before anything reads them, so sharing is
    safe, and graph memory is about the largest size's working set plus the graph objects."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        return t
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape, t.stride())


def weak_refs(obj: Any) -> Any:
    """``weak_ref`` over the tensors of a tuple / list / dict / GraphOutputs."""
    if isinstance(obj, GraphOutputs):
        return GraphOutputs(*(weak_ref(t) for t in (obj.hidden, obj.logits, obj.greedy_ids)))
    if isinstance(obj, (tuple, list)):
        return type(obj)(weak_refs(o) for o in obj)
    if isinstance(obj, dict):
        return {k: weak_refs(v) for k, v in obj.items()}
    return weak_ref(obj)


@dataclass
class GraphOutputs:
    """What one replay leaves in the graph's static tensors (rows past the batch are padding)."""

    hidden: torch.Tensor  # [size * query_len, hidden]
    logits: Optional[torch.Tensor]  # [size * query_len, vocab] float32: every row of a decode or verify samples
    greedy_ids: Optional[torch.Tensor]  # [size * query_len] int64: logits.argmax(-1), for all-greedy batches


class FullCUDAGraphs:
    """One captured whole-forward graph per capture size (in requests), for uniform batches of
    ``query_len`` tokens a request: decodes (1), or speculative verification (k + 1).

    With ``compute_logits`` the graph also holds the logits of every row and their argmax: in a
    decode batch every request samples, so nothing is left to launch per step but the sampler's
    read-back (one argmax launch and a sync saved, and the lm_head launch)."""

    def __init__(self, forward: Forward, buffers: InputBuffers, capture_sizes: tuple[int, ...],
                 compute_logits: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 query_len: int = 1, max_num_reqs: Optional[int] = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = argmax_reference):
        self.forward = forward
        self.compute_logits = compute_logits
        self.argmax = argmax  # the KernelSet's (kiln::argmax or a kernel of its schema)
        self.buffers = buffers
        self.query_len = query_len  # tokens per request: 1 (decode), k + 1 (verify of k proposed tokens)
        max_reqs = min(buffers.max_num_reqs, buffers.max_num_tokens // query_len, max_num_reqs or buffers.max_num_reqs)
        # In requests: the graph of a size runs size * query_len tokens.
        self.sizes = sorted(s for s in capture_sizes if s <= max_reqs)  # planned; captured_sizes: done
        self.captured_sizes: list[int] = []  # sorted
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, GraphOutputs]] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def padded_size(self, num_reqs: int) -> Optional[int]:
        """The smallest captured size that holds ``num_reqs`` requests, or None."""
        return next_capture_size(self.captured_sizes, num_reqs)

    @property
    def pending_sizes(self) -> list[int]:
        """Planned sizes not captured yet, ascending."""
        return [s for s in self.sizes if s not in self._graphs]

    def _run(self, size: int) -> GraphOutputs:
        n = size * self.query_len
        hidden = self.forward(self.buffers.input_ids[:n], self.buffers.positions[:n])
        if self.compute_logits is None:
            return GraphOutputs(hidden, None, None)
        logits = self.compute_logits(hidden)
        return GraphOutputs(hidden, logits, self.argmax(logits))

    @torch.inference_mode()
    def capture(self, scope: CaptureScope, kv_caches: list[torch.Tensor], pool: Optional[tuple] = None,
                log: bool = True, sizes: Optional[list[int]] = None) -> None:
        """Capture ``sizes`` (default: every planned size not captured yet), largest first, into one
        shared pool (``pool``, else a new one), each inside ``scope`` of its capture batch; logs time
        and memory, which add up over calls. Outputs are held weakly (``weak_ref``): a smaller
        size's capture reuses the larger one's memory."""
        sizes = self.pending_sizes if sizes is None else sorted(set(sizes) & set(self.pending_sizes))
        if not sizes:
            return
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        buf = self.buffers
        q = self.query_len
        for size in reversed(sizes):
            # A verify batch (q > 1) runs the prefill kernel's path (no request has one token): its
            # launch depends on num_reqs and max_query_len alone, both fixed by the capture.
            buf.fill_null_requests(0, 0, size, q)
            buf.upload(size * q, size)
            meta = buf.metadata(size * q, size, size if q == 1 else 0, [q] * size, [q] * size)
            with scope(ForwardContext(attn=meta, kv_caches=kv_caches)):
                self._run(size)  # warm-up: Triton JIT, cuBLAS handles, lazy allocations
                torch.cuda.synchronize()  # the next size rewrites the host buffers this one uploaded
                graph = torch.cuda.CUDAGraph()
                with graph_capture(graph, pool):
                    out = self._run(size)
            self._graphs[size] = (graph, weak_refs(out))
            del out
            bisect.insort(self.captured_sizes, size)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' blocks, outside the graph pool
        seconds, memory_bytes = time.perf_counter() - t0, free_before - torch.cuda.mem_get_info()[0]
        self.capture_seconds += seconds
        self.memory_bytes += memory_bytes
        if log:
            logger.info("CUDA graphs (full%s%s): captured %d sizes %s in %.2f s, using %.0f MiB of GPU memory%s",
                        " + logits" if self.compute_logits else "",
                        f", {q} tokens per request" if q > 1 else "", len(sizes), format_sizes(sizes),
                        seconds, memory_bytes / 2**20,
                        f"; {len(self.pending_sizes)} sizes left to capture" if self.pending_sizes else "")

    def replay(self, size: int) -> GraphOutputs:
        """Run the graph of ``size`` on whatever the buffers hold; returns its static outputs."""
        graph, out = self._graphs[size]
        graph.replay()
        return out


def format_sizes(sizes: list[int]) -> str:
    """A size list as the log shows it: all of a short one, the ends of a long one."""
    return str(sizes) if len(sizes) <= 8 else f"[{sizes[0]}, {sizes[1]}, {sizes[2]}, ..., {sizes[-1]}]"
