"""Random paged batches for checking attention kernels against the reference (tests, benchmarks).

One generator for every kernel (C++ on CPU, Triton on GPU), so all are checked on the same kind of
input: decodes first, then prefill chunks with a cached prefix, each request's blocks a random,
out-of-order slice of the pool, and q/k/v as row-strided views of one fused projection (the layout
the model hands the op).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.forward_context import AttentionMetadata


@dataclass(frozen=True)
class PagedBatchSpec:
    """A random mixed batch: decodes first, then prefill chunks given as (seq_len, query_len)."""

    decode_seq_lens: tuple[int, ...] = ()
    prefill_chunks: tuple[tuple[int, int], ...] = ()  # query_len < seq_len: a cached prefix
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    fused_qkv: bool = True  # q/k/v as row-strided views of one [T, (H + 2 KVH) * D] tensor


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], random everywhere
    meta: AttentionMetadata


def random_paged_batch(spec: PagedBatchSpec, device: torch.device | str = "cpu", seed: int = 0) -> PagedBatch:
    """Random q/k/v/cache; each request's blocks are a random, out-of-order slice of the pool."""
    gen = torch.Generator().manual_seed(seed)  # block layout, drawn on the host
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # tensors, drawn where they live
    query_lens = [1] * len(spec.decode_seq_lens) + [q for _, q in spec.prefill_chunks]
    seq_lens = list(spec.decode_seq_lens) + [s for s, _ in spec.prefill_chunks]
    bs = spec.block_size
    blocks_per_req = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks: random data no request may read
    perm = torch.randperm(num_blocks, generator=gen)
    # Table entries past a request's context point at random blocks too: reading them is a bug.
    table = perm[torch.randint(num_blocks, (len(seq_lens), max(blocks_per_req) + 1), generator=gen)]
    slots, used = [], 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        table[i, : blocks_per_req[i]] = perm[used : used + blocks_per_req[i]]
        used += blocks_per_req[i]
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(table[i, pos // bs] * bs + pos % bs)
    num_tokens, h, kvh, hd = sum(query_lens), spec.num_heads, spec.num_kv_heads, spec.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=dev_gen, device=device, dtype=spec.dtype)

    if spec.fused_qkv:
        qkv = randn(num_tokens, (h + 2 * kvh) * hd)
        q, k, v = (t.view(num_tokens, -1, hd) for t in qkv.split([h * hd, kvh * hd, kvh * hd], dim=-1))
    else:
        q, k, v = randn(num_tokens, h, hd), randn(num_tokens, kvh, hd), randn(num_tokens, kvh, hd)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device=device, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(device=device, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device=device, dtype=torch.int32),
        num_decodes=len(spec.decode_seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(q=q, k=k, v=v, kv_cache=randn(2, num_blocks, bs, kvh, hd), meta=meta)
