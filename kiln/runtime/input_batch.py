"""``InputBatch``: the one layout of a scheduled step, written into the compiled model's buffers.

Every device takes the same path: the scheduled requests are written, in order, into the host
mirrors of the ``CompiledModel``'s persistent ``InputBuffers`` (on the CPU those are the tensors the
model reads; on CUDA pinned memory that ``CompiledModel.run`` uploads), and the step is described
by a ``ModelInputs``. Nothing is allocated per step::

    scheduled:  | d0 | d1 | p0 (chunk of 5) ....... |        decodes first, then prefill chunks
    ids/pos:    [ t  | t  | t t t t t ]               one row per new token
    slot:       block_ids[pos // block_size] * block_size + pos % block_size
    table row i: request i's block ids (row width fixed: cdiv(max_model_len, block_size))
    qsl:        [0, 1, 2, 7]     seq_lens: [start + num_new_tokens per request]
    sample_rows: the last token row of every request whose chunk reaches its last known token

A decode whose input token is still a placeholder (its step is in flight: the scheduler's
``schedule_ahead``) gets id 0 in the host mirror; ``placeholder_rows`` then lists its token row and
request id, for the model runner to feed the real token from the device.

The block table row of a request is rewritten each step (its block list only grows, but a row
may change owner from one step to the next); entries past a request's blocks are never read.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.compiler.inputs import InputBuffers, ModelInputs
from kiln.runtime.scheduler_output import SchedulerOutput


class InputBatch:
    """Lays out steps into ``buffers`` (owned by the compiled model), for a KV cache of ``block_size``."""

    def __init__(self, buffers: InputBuffers, block_size: int) -> None:
        self.buffers = buffers
        self.block_size = block_size
        self.placeholder_rows: list[tuple[int, str]] = []  # of the last prepare: (token row, request id)

    def prepare(self, sched: SchedulerOutput, drafts: Optional[dict[str, list[int]]] = None,
                lora_slots: Optional[list[int]] = None) -> tuple[ModelInputs, list[int]]:
        """Write ``sched`` into the host mirrors; returns the step's shape and its sample rows.

        ``drafts``: speculative decoding's proposed tokens per request (at most its lookahead
        slots); they follow its last known token, and each of its rows is a sample row.
        ``lora_slots``: each scheduled request's LoRA slot (0: the base model), written to every
        token row of the request."""
        buf, bs = self.buffers, self.block_size
        # A step that samples nothing (a prefill chunk) is not read back: its upload may still be
        # pending when the next step is prepared, and must read the mirrors it was given.
        buf.wait_for_upload()
        if len(sched.scheduled) > buf.max_num_reqs or sched.num_batched_tokens > buf.max_num_tokens:
            raise ValueError(f"a step of {len(sched.scheduled)} requests and {sched.num_batched_tokens} tokens "
                             f"exceeds the input buffers ({buf.max_num_reqs} requests, {buf.max_num_tokens} tokens)")
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        num_tokens = 0
        placeholders = self.placeholder_rows = []
        buf.qsl_np[0] = 0
        for i, s in enumerate(sched.scheduled):
            start, n = s.start, s.num_new_tokens - s.num_lookahead_tokens
            draft = drafts.get(s.request.request_id, ()) if drafts and s.num_lookahead_tokens else ()
            blocks = s.block_ids
            buf.table_np[i, : len(blocks)] = blocks
            if n == 1 and not draft:  # a decode: scalar writes, no arrays
                token = s.request.token_ids_slice(start, start + 1)[0]
                if token < 0:  # still in flight: fed from the device
                    placeholders.append((num_tokens, s.request.request_id))
                    token = 0
                buf.ids_np[num_tokens] = token
                buf.pos_np[num_tokens] = start
                buf.slot_np[num_tokens] = blocks[start // bs] * bs + start % bs
            else:
                ids = s.request.token_ids_slice(start, start + n)
                if ids[-1] < 0:
                    raise ValueError(f"request {s.request.request_id}: a chunk of {n} tokens ends in a token "
                                     "still in flight (only a decode can be scheduled ahead of its token)")
                if draft:
                    ids = ids + list(draft)
                    n += len(draft)
                self.write_chunk(i, num_tokens, start, ids)
            if lora_slots is not None:
                buf.lora_slot_np[num_tokens:num_tokens + n] = lora_slots[i]
            num_tokens += n
            buf.seq_lens_np[i] = start + n
            buf.qsl_np[i + 1] = num_tokens
            query_lens.append(n)
            seq_lens.append(start + n)
            if s.samples:
                sample_rows.extend(range(num_tokens - 1 - len(draft), num_tokens))
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        return ModelInputs(num_tokens, num_decodes, query_lens, seq_lens), sample_rows

    def write_chunk(self, row: int, first_token: int, start: int, ids: list[int]) -> None:
        """Tokens ``ids`` at positions ``start..`` of the request in table row ``row``, written at
        token rows ``first_token..`` (the table row must be written first)."""
        buf, bs = self.buffers, self.block_size
        end = first_token + len(ids)
        pos = np.arange(start, start + len(ids))
        buf.ids_np[first_token:end] = ids
        buf.pos_np[first_token:end] = pos
        buf.slot_np[first_token:end] = buf.table_np[row, pos // bs].astype(np.int64) * bs + pos % bs
