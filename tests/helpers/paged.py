"""Lay out flat batches of requests over a toy paged KV cache and run the model.

``PagedBatcher`` plays the scheduler and block manager in miniature: it keeps each request's
blocks across steps and hands blocks out from a shuffled pool, so a passing test cannot rely on a
request's blocks being contiguous or ascending. Within a step, decode requests (one new token on a
non-empty context) come first, as ``kiln.forward_context`` requires.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Hashable

import torch

from kiln.forward_context import AttentionMetadata, ForwardContext, forward_context
from kiln.models.arch import ArchConfig


def make_kv_caches(arch: ArchConfig, num_blocks: int, block_size: int, dtype=torch.float32, device="cpu"):
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer, zeroed."""
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]


def build_metadata(
    seq_lens_before: list[int], query_lens: list[int], block_tables: list[list[int]], block_size: int, device="cpu"
) -> AttentionMetadata:
    """Metadata for requests already ordered decodes first; request i owns ``block_tables[i]``."""
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1 and seq_lens_before[num_decodes] > 0:
        num_decodes += 1
    for i in range(num_decodes, len(query_lens)):
        assert not (query_lens[i] == 1 and seq_lens_before[i] > 0), "decode requests must come first"
    seq_lens = [b + q for b, q in zip(seq_lens_before, query_lens)]
    slots = [
        block_tables[i][pos // block_size] * block_size + pos % block_size
        for i, (before, total) in enumerate(zip(seq_lens_before, seq_lens))
        for pos in range(before, total)
    ]
    max_blocks = max(len(t) for t in block_tables)
    # Unused table entries point at block 0: kernels must never read past a request's seq_len.
    table = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    start_loc = [0]
    for q in query_lens:
        start_loc.append(start_loc[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(table, dtype=torch.int32, device=device),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )


@dataclass
class Step:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    req_ids: list  # request of each batch row group, in batch order (decodes first)
    last_token_rows: torch.Tensor  # [num_reqs] int64: row of each request's last new token


class PagedBatcher:
    def __init__(self, num_blocks: int, block_size: int, seed: int = 0, device="cpu") -> None:
        self.block_size, self.device = block_size, device
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_ids: dict[Hashable, list[int]] = {}
        self.num_computed: dict[Hashable, int] = {}

    def step(self, new_tokens: dict[Hashable, list[int]]) -> Step:
        """Lay out one forward: each request's next tokens, continuing where its last step ended."""
        def is_decode(r):
            return len(new_tokens[r]) == 1 and self.num_computed.get(r, 0) > 0

        order = [r for r in new_tokens if is_decode(r)] + [r for r in new_tokens if not is_decode(r)]
        before = [self.num_computed.get(r, 0) for r in order]
        query_lens = [len(new_tokens[r]) for r in order]
        for r, b, q in zip(order, before, query_lens):
            blocks = self.block_ids.setdefault(r, [])
            while len(blocks) * self.block_size < b + q:
                blocks.append(self.free_blocks.pop())
            self.num_computed[r] = b + q
        meta = build_metadata(before, query_lens, [self.block_ids[r] for r in order], self.block_size, self.device)
        ids = [t for r in order for t in new_tokens[r]]
        positions = [p for b, q in zip(before, query_lens) for p in range(b, b + q)]
        return Step(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta=meta,
            req_ids=order,
            last_token_rows=meta.query_start_loc[1:].long() - 1,
        )


def run_step(model, kv_caches, step: Step) -> torch.Tensor:
    """Final hidden states [num_tokens, hidden] of one forward over ``step``."""
    with torch.inference_mode(), forward_context(ForwardContext(attn=step.meta, kv_caches=kv_caches)):
        return model(step.input_ids, step.positions)


def split_rows(x: torch.Tensor, step: Step) -> dict:
    """Per request, its rows of ``x`` ([num_tokens, ...]): request id -> [query_len, ...]."""
    loc = step.meta.query_start_loc.tolist()
    return {r: x[loc[i]:loc[i + 1]] for i, r in enumerate(step.req_ids)}
