"""The compiled model's inputs: persistent step buffers, and the shape of one step.

``InputBuffers`` holds a step's inputs (token ids, positions) and attention metadata (slot mapping,
seq lens, query start locations, block tables) in persistent device tensors, each with a host
mirror (pinned on CUDA; on the CPU the mirror *is* the tensor the model reads). A ``CompiledModel``
owns one: captured CUDA graphs read their inputs at these addresses, so they never move. The
runtime (``kiln.runtime.input_batch``) writes a scheduled step into the host mirrors and describes
it with a ``ModelInputs``; ``CompiledModel.run`` pads, uploads and runs it::

    host (pinned)  ids_np[:n] = ...   --upload: copy_(non_blocking)-->  input_ids[:n]   (device)
    int64: [ input_ids T | positions T | slot_mapping T ]
    int32: [ seq_lens R | query_start_loc R+1 | block_tables R*W ]
    block_tables: [max_num_reqs, max_blocks_per_req] int32, one row per request, row width fixed at
                  cdiv(max_model_len, block_size) so a graph's stride never changes

Padding only ever reads and writes the null block 0, which the block pool never hands out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kiln.forward_context import AttentionMetadata

NULL_BLOCK_ID = 0  # kiln.runtime.block_pool: never handed out, never freed


@dataclass(frozen=True)
class InputLimits:
    """The largest step the buffers hold."""

    max_num_tokens: int
    max_num_reqs: int
    max_blocks_per_req: int
    lora_slots: bool = False  # multi-LoRA: a per-token adapter slot buffer (``lora_slots``)


@dataclass(frozen=True)
class VerifyShape:
    """Speculative decoding's verify steps: ``query_len`` (k + 1) tokens for each of up to
    ``max_num_reqs`` requests; full CUDA graphs are captured for this shape too."""

    query_len: int
    max_num_reqs: int


@dataclass
class ModelInputs:
    """One step as the runtime laid it out in the host mirrors: rows ``[0, num_tokens)`` of the
    token buffers and ``[0, num_reqs)`` of the request buffers; decodes first, then prefill chunks."""

    num_tokens: int
    num_decodes: int  # the first num_decodes requests have exactly one new token
    query_lens: list[int]  # one per request
    seq_lens: list[int]  # one per request: context length after this step

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    # Token ids already on the device for rows [0, len) (a draft model's own argmax, fed back
    # without a host read): they replace the host mirror's ids once the step is uploaded.
    device_input_ids: Optional[torch.Tensor] = None
    # A step with image tokens: (token rows [M] int64, vision embeddings [M, hidden]) on the device,
    # which ``kiln.merge_mm_embeds`` writes over those rows' token embeddings; such a step runs
    # without CUDA graphs (a graph would replay the embeddings of its capture).
    mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def is_uniform_decode(self) -> bool:
        return self.num_decodes == self.num_reqs

    @property
    def uniform_query_len(self) -> int:
        """q when every request has exactly q new tokens (a uniform decode: 1; a uniform verify of k
        proposed tokens: k + 1), else 0."""
        q = self.query_lens[0] if self.query_lens else 0
        return q if self.num_tokens == q * self.num_reqs and all(n == q for n in self.query_lens) else 0


def next_capture_size(sizes: list[int], n: int) -> Optional[int]:
    """The smallest of the (sorted) ``sizes`` that is ``>= n``, or None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class InputBuffers:
    """Persistent inputs of one step on ``device``, with pinned host mirrors (numpy views)."""

    def __init__(self, limits: InputLimits, device: torch.device):
        self.device = device
        self.limits = limits
        self.max_num_tokens, self.max_num_reqs = limits.max_num_tokens, limits.max_num_reqs
        self.max_blocks_per_req = limits.max_blocks_per_req
        self.on_host = device.type == "cpu"  # the mirrors are the tensors the model reads: no upload
        pin = device.type == "cuda"
        T, R, W = limits.max_num_tokens, limits.max_num_reqs, limits.max_blocks_per_req
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
        self._i64_d = self._i64_h if self.on_host else torch.zeros(3 * T64, dtype=torch.int64, device=device)
        self._i32_d = self._i32_h if self.on_host else torch.zeros(2 * R32 + R * W, dtype=torch.int32, device=device)
        self._t64 = T64
        i64_np, i32_np = self._i64_h.numpy(), self._i32_h.numpy()
        self.ids_np, self.pos_np, self.slot_np = i64_np[:T], i64_np[T64:T64 + T], i64_np[2 * T64:2 * T64 + T]
        self.seq_lens_np, self.qsl_np = i32_np[:R], i32_np[R32:R32 + R + 1]
        self.table_np = i32_np[2 * R32:].reshape(R, W)
        d64, d32 = self._i64_d, self._i32_d
        self.input_ids, self.positions, self.slot_mapping = d64[:T], d64[T64:T64 + T], d64[2 * T64:2 * T64 + T]
        self.seq_lens, self.query_start_loc = d32[:R], d32[R32:R32 + R + 1]
        self.block_tables = d32[2 * R32:].view(R, W)
        # Multi-LoRA: each token's adapter slot (0: the base model), read by kiln.add_lora through
        # the forward context; padding rows are slot 0.
        self.lora_slots: Optional[torch.Tensor] = None
        if limits.lora_slots:
            self._lora_h = torch.zeros(T, dtype=torch.int32, pin_memory=pin)
            self.lora_slots = self._lora_h if self.on_host else torch.zeros(T, dtype=torch.int32, device=device)
            self.lora_slot_np = self._lora_h.numpy()
        # Recorded after each upload's copies: until it completes they may still read the host
        # mirrors, which must not be rewritten (``wait_for_upload``).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def fill_null_requests(self, first_req: int, first_token: int, num_reqs: int, query_len: int = 1) -> None:
        """Host side: requests [first_req, num_reqs) become ``query_len``-token requests of the null
        block: positions 0..query_len-1, every token written to slot 0, seq_len query_len, the first
        query_len table entries null (at least the blocks of query_len keys, for any block size)::

            query_len 3:  ids [0 0 0]  pos [0 1 2]  slot [0 0 0]  seq_len 3  table [0 ..]  qsl +3
        """
        num_null = num_reqs - first_req
        end_tok = first_token + num_null * query_len
        self.ids_np[first_token:end_tok] = 0
        self.pos_np[first_token:end_tok] = np.tile(np.arange(query_len), num_null)
        self.slot_np[first_token:end_tok] = NULL_BLOCK_ID
        if self.lora_slots is not None:
            self.lora_slot_np[first_token:end_tok] = 0
        self.seq_lens_np[first_req:num_reqs] = query_len
        self.table_np[first_req:num_reqs, :query_len] = NULL_BLOCK_ID
        self.qsl_np[first_req + 1:num_reqs + 1] = np.arange(first_token + query_len, end_tok + 1, query_len)

    def pad_tokens(self, first_token: int, num_tokens: int) -> None:
        """Host side: token rows [first_token, num_tokens) become padding that no request owns:
        token 0, position 0, slot 0 of the null block (piecewise graphs run them, attention never sees them)."""
        self.ids_np[first_token:num_tokens] = 0
        self.pos_np[first_token:num_tokens] = 0
        self.slot_np[first_token:num_tokens] = NULL_BLOCK_ID
        if self.lora_slots is not None:
            self.lora_slot_np[first_token:num_tokens] = 0

    def upload(self, num_tokens: int, num_reqs: int) -> None:
        """Copy the filled host prefixes to the device (asynchronous: the host buffers are only
        rewritten by the next step's prepare, after this step's forward has been enqueued). The int64
        copy covers ids and positions whole and the slot prefix; the int32 one covers seq lens and
        query starts whole and the first ``num_reqs`` table rows: stale entries past a prefix are
        never read."""
        if self.on_host:
            return
        n64 = 2 * self._t64 + num_tokens
        n32 = self._table_start + num_reqs * self.max_blocks_per_req
        self._i64_d[:n64].copy_(self._i64_h[:n64], non_blocking=True)
        self._i32_d[:n32].copy_(self._i32_h[:n32], non_blocking=True)
        if self.lora_slots is not None:
            self.lora_slots[:num_tokens].copy_(self._lora_h[:num_tokens], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def wait_for_upload(self) -> None:
        """Host side: wait until the last upload's copies have read the host mirrors, so the next
        step may rewrite them. A caller that reads results back each step (the engine's target
        model) never waits here; one that launches several steps without a read-back (a draft
        model's k steps) must call this before writing each next step: the copies run only once
        the stream reaches them, i.e. after the step before has run."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def set_device_input_ids(self, ids: Optional[torch.Tensor]) -> None:
        """Device side, after ``upload``: rows [0, len(ids)) take ``ids`` (stream-ordered, no sync)."""
        if ids is not None:
            self.input_ids[:ids.shape[0]].copy_(ids, non_blocking=True)

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
