"""Triton KV store: write the step's new keys and values into the paged cache.

Reference: ``kiln.ops.attention.store_kv_reference`` (two ``index_copy_``). The kernel is one program
per new token; it copies that token's ``num_kv_heads x head_dim`` row of K and of V into its slot::

    k[t] : [num_kv_heads, head_dim]  (rows may be a strided view of the fused qkv projection)
      |  slot = slot_mapping[t] = block_id * block_size + offset
      v
    kv_cache[0][block_id][offset] : [num_kv_heads, head_dim]   (and kv_cache[1] for v)

The copy casts to the cache dtype, exactly like the reference, so the two must agree bit for bit.
An FP8 cache with scales (``kv_scale``, see ``kiln.ops.attention``) stores clamp(x / scale, +-448):
the division is IEEE-rounded (``div_rn``) as torch's is, so the bits still match on the GPU.
Correctness check: ``tests/ops/test_triton_attention.py``; timing: ``python -m benchmarks.kernels attention``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.ops.attention import fp8_kv_scale


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    kv_scale_ptr,  # [2] float32 (k_scale, v_scale); read only when SCALED
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
    SCALED: tl.constexpr = False,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_POW2)
    d = tl.arange(0, HEAD_DIM_P2)
    mask = (heads < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs + heads[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    if SCALED:
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), tl.load(kv_scale_ptr)), -448.0, 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
    if SCALED:
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), tl.load(kv_scale_ptr + 1)), -448.0, 448.0)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def triton_store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    *, kv_scale: Optional[torch.Tensor] = None) -> None:
    """Same contract as ``store_kv_reference``. k, v: [num_tokens, num_kv_heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("triton_store_kv needs head_dim to be the contiguous dimension of k, v and the cache")
    kv_scale = fp8_kv_scale(kv_cache, kv_scale)
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        kv_scale if kv_scale is not None else slot_mapping,
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
        SCALED=kv_scale is not None,
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
