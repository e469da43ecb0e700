"""CUDA graphs: persistent step inputs, one graph per capture size, and the per-batch dispatch.

What this module owns:

- ``StepBuffers``: the step's inputs (token ids, positions) and attention metadata (slot mapping,
  seq lens, query start locations, block tables) in persistent device tensors, each with a pinned
  host mirror. The model runner fills the mirrors and uploads prefixes every step, so a step builds
  no new tensors, and a captured graph finds its inputs at the addresses it was captured with::

      host (pinned)  input_ids_np[:n] = ...   --copy_(non_blocking)-->  input_ids[:n]   (device)
      block_tables: [max_num_reqs, max_blocks_per_req] int32, one row per request, row width
                    fixed at cdiv(max_model_len, block_size) so a graph's stride never changes

- ``FullCUDAGraphs``: ``compile.cudagraph=full``: the whole forward, attention included, captured
  once per capture size for uniform decode batches (every request has one new token), with the
  logits of every row and their argmax (every decode samples). A batch of
  ``n`` requests replays the graph of the next capture size ``>= n``; the padded requests read and
  write only the null block 0 (token 0, position 0, slot 0, seq_len 1), which the block pool never
  hands out, so they cannot touch a real request's cache.

- ``dispatch``: which runtime path a batch takes (``GraphMode``)::

      decode-only, requests fit a full size  -> FULL       (requests padded with null decodes)
      otherwise, tokens fit a piecewise size -> PIECEWISE  (tokens padded, attention sees the real ones)
      otherwise                              -> NONE       (the forward as built, no padding)

  ``piecewise`` graphs (the pieces between attention ops, ``compile.mode=kiln`` only) live in
  ``kiln.compiler.piecewise``.

Rules kept here: captures happen at start-up, never while serving; all graphs share one memory
pool and are captured from the largest size down, so smaller graphs reuse the larger one's
blocks; the Triton decode kernel is captured inside ``static_decode_splits(max_model_len)`` so its
split count does not depend on the capture batch's context lengths. Padding only ever reads and
writes the null block.
"""

from __future__ import annotations

import bisect
import enum
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from kiln.forward_context import AttentionMetadata, ForwardContext, forward_context

if TYPE_CHECKING:
    from kiln.compiler.piecewise import PiecewiseCUDAGraphs

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
NULL_BLOCK_ID = 0  # kiln.runtime.block_pool: never handed out, never freed


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


def next_capture_size(sizes: list[int], n: int) -> Optional[int]:
    """The smallest of the (sorted) ``sizes`` that is ``>= n``, or None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class StepBuffers:
    """Persistent inputs of one step on ``device``, with pinned host mirrors (numpy views)."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, device: torch.device):
        self.device = device
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        pin = device.type == "cuda"
        T, R, W = max_num_tokens, max_num_reqs, max_blocks_per_req
        # Two flat buffers per side, so a step uploads with two copies, not six (each copy is a
        # few microseconds of host time, which a batch-1 decode step cannot hide). Each part
        # starts on a 64-byte boundary, as kernels specialise on pointer alignment::
        #
        #   int64: [ input_ids T | positions T | slot_mapping T ]
        #   int32: [ seq_lens R | query_start_loc R+1 | block_tables R*W ]
        T64, R32 = -(-T // 8) * 8, -(-(R + 1) // 16) * 16
        self._table_start = 2 * R32
        self._i64_h = torch.zeros(3 * T64, dtype=torch.int64, pin_memory=pin)
        self._i32_h = torch.zeros(2 * R32 + R * W, dtype=torch.int32, pin_memory=pin)
        self._i64_d = torch.zeros(3 * T64, dtype=torch.int64, device=device)
        self._i32_d = torch.zeros(2 * R32 + R * W, dtype=torch.int32, device=device)
        self._t64 = T64
        i64_np, i32_np = self._i64_h.numpy(), self._i32_h.numpy()
        self.ids_np, self.pos_np, self.slot_np = i64_np[:T], i64_np[T64:T64 + T], i64_np[2 * T64:2 * T64 + T]
        self.seq_lens_np, self.qsl_np = i32_np[:R], i32_np[R32:R32 + R + 1]
        self.table_np = i32_np[2 * R32:].reshape(R, W)
        d64, d32 = self._i64_d, self._i32_d
        self.input_ids, self.positions, self.slot_mapping = d64[:T], d64[T64:T64 + T], d64[2 * T64:2 * T64 + T]
        self.seq_lens, self.query_start_loc = d32[:R], d32[R32:R32 + R + 1]
        self.block_tables = d32[2 * R32:].view(R, W)

    def fill_null_requests(self, first_req: int, first_token: int, num_reqs: int) -> None:
        """Host side: requests [first_req, num_reqs) become one-token decodes of the null block."""
        end_tok = first_token + (num_reqs - first_req)
        self.ids_np[first_token:end_tok] = 0
        self.pos_np[first_token:end_tok] = 0
        self.slot_np[first_token:end_tok] = NULL_BLOCK_ID
        self.seq_lens_np[first_req:num_reqs] = 1
        self.table_np[first_req:num_reqs, 0] = NULL_BLOCK_ID
        self.qsl_np[first_req + 1:num_reqs + 1] = np.arange(first_token + 1, end_tok + 1)

    def pad_tokens(self, first_token: int, num_tokens: int) -> None:
        """Host side: token rows [first_token, num_tokens) become padding that no request owns:
        token 0, position 0, slot 0 of the null block (piecewise graphs run them, attention never sees them)."""
        self.ids_np[first_token:num_tokens] = 0
        self.pos_np[first_token:num_tokens] = 0
        self.slot_np[first_token:num_tokens] = NULL_BLOCK_ID

    def upload(self, num_tokens: int, num_reqs: int) -> None:
        """Copy the filled host prefixes to the device (asynchronous: the host buffers are only
        rewritten by the next step's prepare, after this step's forward has been enqueued). The int64
        copy covers ids and positions whole and the slot prefix; the int32 one covers seq lens and
        query starts whole and the first ``num_reqs`` table rows: stale entries past a prefix are
        never read."""
        n64 = 2 * self._t64 + num_tokens
        n32 = self._table_start + num_reqs * self.max_blocks_per_req
        self._i64_d[:n64].copy_(self._i64_h[:n64], non_blocking=True)
        self._i32_d[:n32].copy_(self._i32_h[:n32], non_blocking=True)

    def metadata(self, num_tokens: int, num_reqs: int, num_decodes: int,
                 query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        """Views of the device buffers for a batch of ``num_reqs`` requests."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[:num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_tables=self.block_tables[:num_reqs],
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )


@dataclass
class GraphOutputs:
    """What one replay leaves in the graph's static tensors (rows past the batch are padding)."""

    hidden: torch.Tensor  # [size, hidden]
    logits: Optional[torch.Tensor]  # [size, vocab] float32: every row of a decode batch samples
    greedy_ids: Optional[torch.Tensor]  # [size] int64: logits.argmax(-1), for all-greedy batches


class FullCUDAGraphs:
    """One captured whole-forward graph per capture size, for uniform decode batches.

    With ``compute_logits`` the graph also holds the logits of every row and their argmax: in a
    decode batch every request samples, so nothing is left to launch per step but the sampler's
    read-back (one argmax launch and a sync saved, and the lm_head launch)."""

    def __init__(self, forward: Forward, buffers: StepBuffers, capture_sizes: tuple[int, ...], max_model_len: int,
                 compute_logits: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.forward = forward
        self.compute_logits = compute_logits
        self.buffers = buffers
        self.sizes = sorted(s for s in capture_sizes if s <= min(buffers.max_num_reqs, buffers.max_num_tokens))
        self.max_model_len = max_model_len
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, GraphOutputs]] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def padded_size(self, num_reqs: int) -> Optional[int]:
        """The smallest capture size that holds ``num_reqs`` requests, or None."""
        return next_capture_size(self.sizes, num_reqs)

    def _run(self, size: int) -> GraphOutputs:
        hidden = self.forward(self.buffers.input_ids[:size], self.buffers.positions[:size])
        if self.compute_logits is None:
            return GraphOutputs(hidden, None, None)
        logits = self.compute_logits(hidden)
        return GraphOutputs(hidden, logits, logits.argmax(dim=-1))

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor], pool: Optional[tuple] = None) -> None:
        """Capture every size, largest first, into one shared pool (``pool``, else a new one);
        logs time and memory."""
        from kiln.ops.triton_attention import static_decode_splits

        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        buf = self.buffers
        for size in reversed(self.sizes):
            buf.fill_null_requests(0, 0, size)
            buf.upload(size, size)
            meta = buf.metadata(size, size, size, [1] * size, [1] * size)
            ctx = ForwardContext(attn=meta, kv_caches=kv_caches)
            with forward_context(ctx), static_decode_splits(self.max_model_len):
                for _ in range(2):  # warm-up: Triton JIT, cuBLAS handles, lazy allocations
                    self._run(size)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._run(size)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = free_before - torch.cuda.mem_get_info()[0]
        logger.info("CUDA graphs (full%s): captured %d sizes %s in %.2f s, using %.0f MiB of GPU memory",
                    " + logits" if self.compute_logits else "", len(self.sizes), self.sizes,
                    self.capture_seconds, self.memory_bytes / 2**20)

    def replay(self, size: int) -> GraphOutputs:
        """Run the graph of ``size`` on whatever the buffers hold; returns its static outputs."""
        graph, out = self._graphs[size]
        graph.replay()
        return out


def dispatch(full: Optional[FullCUDAGraphs], piecewise: Optional[PiecewiseCUDAGraphs],
             num_tokens: int, num_reqs: int, num_decodes: int) -> tuple[GraphMode, int]:
    """The path of one batch and the number of tokens it runs with, padding included.

    A uniform decode batch that fits a full capture size replays a full graph (its requests padded
    to that size, one token each); any other batch whose tokens fit a piecewise capture size
    replays piece graphs (its tokens padded); anything else runs without graphs, unpadded.
    ``full`` / ``piecewise`` are None when that kind of graph is off."""
    if full is not None and num_decodes == num_reqs:
        size = full.padded_size(num_reqs)
        if size is not None:
            return GraphMode.FULL, size
    if piecewise is not None:
        size = piecewise.padded_size(num_tokens)
        if size is not None:
            return GraphMode.PIECEWISE, size
    return GraphMode.NONE, num_tokens
