"""Paged attention: ``torch.ops.kiln.attend_paged``.

One op writes the step's new K/V into the paged cache and attends each request's queries over its
whole context (cached prefix plus the new tokens), causally. Cache and metadata come from the
forward context (``kiln.forward_context``), so the compiled graph carries no cache tensors and no
Python objects: the op is opaque to Dynamo and a natural split point for the compiler.

Cache layout, one tensor per layer::

    kv_cache[0 = K | 1 = V][block_id][offset in block][kv_head][head_dim]
    slot = block_id * block_size + offset

This module holds the schema, the fake (meta) implementation and the pure-torch reference. Faster
kernels (C++ on CPU, Triton on GPU) define ops of the same schema with ``define_attention_op``;
``kiln.ops.registry`` chooses among them. The generic op runs the kernel the forward context names
(``ForwardContext.attention_impl``), else the reference: that is how eager and stock modes reach the
device's kernel, while kiln's attention pass writes the kernel's own op into the graph.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kiln.forward_context import AttentionMetadata, get_forward_context

AttentionImpl = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


_FP8_DTYPES = (torch.float8_e4m3fn,)  # cache.dtype=fp8: indexing ops lack it on the CPU, so bytes move


def _rows(kv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``kv[index]``, for float8 caches too."""
    return kv.view(torch.uint8)[index].view(kv.dtype) if kv.dtype in _FP8_DTYPES else kv[index]


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new keys/values into their slots. k, v: [num_tokens, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if kv_cache.dtype in _FP8_DTYPES:
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather_context(kv: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """kv: [num_blocks, block_size, H, D] -> [seq_len, H, D] for one request."""
    block_size = kv.shape[1]
    num_blocks = -(-seq_len // block_size)
    return _rows(kv, block_table[:num_blocks].long()).flatten(0, 1)[:seq_len]


def attend_paged_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Pure-torch paged attention: the definition every kernel is checked against."""
    store_kv_reference(k, v, kv_cache, meta.slot_mapping)
    num_heads = q.shape[1]
    group = num_heads // k.shape[1]
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd > 0:
        _attend_decodes(q[:nd], kv_cache, meta, scale, group, out[:nd])
    start_loc = meta.query_start_loc.tolist() if nd < meta.num_reqs else []
    for i in range(nd, meta.num_reqs):
        s, e = start_loc[i], start_loc[i + 1]
        seq_len, q_len = meta.seq_lens_cpu[i], e - s
        keys = _gather_context(kv_cache[0], meta.block_tables[i], seq_len)  # [seq_len, kvh, D]
        vals = _gather_context(kv_cache[1], meta.block_tables[i], seq_len)
        # Query j (0-based in the chunk) sits at context position seq_len - q_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1),
            keys.transpose(0, 1).to(q.dtype).repeat_interleave(group, 0),
            vals.transpose(0, 1).to(q.dtype).repeat_interleave(group, 0),
            attn_mask=mask,
            scale=scale,
        )
        out[s:e] = o.transpose(0, 1)
    return out


def _attend_decodes(q, kv_cache, meta, scale, group, out) -> None:
    """All decode requests at once: pad each context to the longest, mask the tail."""
    nd = q.shape[0]
    seq_lens = meta.seq_lens[:nd].long()
    block_size = kv_cache.shape[2]
    max_blocks = -(-max(meta.seq_lens_cpu[:nd]) // block_size)
    table = meta.block_tables[:nd, :max_blocks].long()  # [nd, max_blocks]
    keys = _rows(kv_cache[0], table).flatten(1, 2)  # [nd, max_len, kvh, D]
    vals = _rows(kv_cache[1], table).flatten(1, 2)
    max_len = keys.shape[1]
    kvh, head_dim = keys.shape[2], keys.shape[3]
    qg = q.view(nd, kvh, group, head_dim).to(torch.float32)  # [nd, kvh, group, D]
    scores = torch.einsum("nhgd,nlhd->nhgl", qg, keys.to(torch.float32)) * scale
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [nd, max_len]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    o = torch.einsum("nhgl,nlhd->nhgd", probs, vals.to(torch.float32))
    out.copy_(o.reshape(nd, kvh * group, head_dim).to(out.dtype))


def define_attention_op(qualname: str, impl: Optional[AttentionImpl]):
    """Define op ``qualname`` with the schema of ``kiln::attend_paged``: it runs ``impl`` on the
    cache and metadata of the forward context (``impl=None``: the context's ``attention_impl``, else
    the reference). Kernel packages define theirs with this, so every attention op a graph can hold
    reads the context the same way."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx.attn is None:
            raise RuntimeError(f"{qualname} needs attention metadata in the forward context")
        run = impl or ctx.attention_impl or attend_paged_reference
        return run(q, k, v, ctx.kv_caches[layer_idx], ctx.attn, scale)

    op = torch.library.custom_op(qualname, attend, mutates_args=())
    op.register_fake(lambda q, k, v, layer_idx, scale: torch.empty_like(q))
    return op


# Store k/v of the new tokens in layer ``layer_idx``'s cache and attend; returns [T, H, D].
attend_paged = define_attention_op("kiln::attend_paged", None)
