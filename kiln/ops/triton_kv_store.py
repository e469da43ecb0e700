"""Triton KV store: write the step's new keys and values into the paged cache.

Reference: ``kiln.ops.attention.store_kv_reference`` (two ``index_copy_``). The kernel is one program
per new token; it copies that token's ``num_kv_heads x head_dim`` row of K and of V into its slot::

    k[t] : [num_kv_heads, head_dim]  (rows may be a strided view of the fused qkv projection)
      |  slot = slot_mapping[t] = block_id * block_size + offset
      v
    kv_cache[0][block_id][offset] : [num_kv_heads, head_dim]   (and kv_cache[1] for v)

The copy casts to the cache dtype, exactly like the reference, so the two must agree bit for bit.
Correctness check: ``tests/test_triton_attention.py``; timing: ``benchmarks/attention_kernels.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides (shared by K and V): block, offset in block, kv head
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,  # HEAD_DIM rounded up to a power of two (Phi-3's 96 -> 128)
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_POW2)
    d = tl.arange(0, HEAD_DIM_P2)
    mask = (heads < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs + heads[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def triton_store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as ``store_kv_reference``. k, v: [num_tokens, num_kv_heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("triton_store_kv needs head_dim to be the contiguous dimension of k, v and the cache")
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_POW2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        PAGE_SIZE=kv_cache.shape[2],
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
