"""Triton rotary embedding of q and k in one launch: ``triton_rotate_qk``.

Reference: ``kiln.ops.attention.rotate_reference`` (rotate-half, neox layout: the Llama family's
``apply_rope``). ``kiln_triton::attend_paged_rope`` rotates inside the decode kernel where that
kernel stores the new keys itself (a decode-only batch); every other batch (prefills, decodes
beside a prefill chunk, padded rows) is rotated here first, then takes the unrotated op's way.
One program per token rotates all its query and key heads, so a layer pays one launch, as the
rotary kernel Inductor made of the model's own ops did::

    q[t] : [num_heads, head_dim]     (strided views of the fused qkv projection)
    k[t] : [num_kv_heads, head_dim]
    out[t, h, d] = x[t, h, d] * cos[t, d] + x[t, h, partner(d)] * sin_signed[t, d]   for d < R
                   x[t, h, d]                                                          for d >= R
    partner(d) = (d + R / 2) mod R

The products are float32, rounded once to x's dtype, as Inductor's kernel and the reference do.
Correctness check: ``tests/ops/test_triton_attention.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_st, stride_sh, stride_dt, stride_dh, cos, sin, d, partner, d_ok,
                  NUM_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr):
    heads = tl.arange(0, HEADS_POW2)
    mask = (heads < NUM_HEADS)[:, None] & d_ok[None, :]
    row = src_ptr + token * stride_st + heads[:, None] * stride_sh
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    pair = tl.load(row + partner[None, :], mask=mask, other=0.0)
    out = x.to(tl.float32) * cos[None, :] + pair.to(tl.float32) * sin[None, :]
    tl.store(dst_ptr + token * stride_dt + heads[:, None] * stride_dh + d[None, :],
             out.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_qk_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_oqt, stride_oqh, stride_okt, stride_okh,
    stride_cos, stride_sin,
    NUM_HEADS: tl.constexpr, Q_HEADS_POW2: tl.constexpr, NUM_KV_HEADS: tl.constexpr, K_HEADS_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, ROT_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    r_ok = d < ROT_DIM
    partner = tl.where(r_ok, (d + ROT_DIM // 2) % ROT_DIM, d)
    cos = tl.load(cos_ptr + token * stride_cos + d, mask=r_ok, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + d, mask=r_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_oqt, stride_oqh, cos, sin, d, partner, d_ok,
                  NUM_HEADS, Q_HEADS_POW2)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_okt, stride_okh, cos, sin, d, partner, d_ok,
                  NUM_KV_HEADS, K_HEADS_POW2)


def rotary_rows(table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``table`` [T or 1, 1, R] as the kernels read it: one row per token (a broadcast row at stride
    0), the R values of a row contiguous. The model's own tables pass through untouched."""
    if table.stride(-1) != 1:
        table = table.contiguous()
    return table if table.shape[0] == num_tokens else table.expand(num_tokens, 1, table.shape[-1])


def triton_rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotate_reference(q, cos, sin_signed), rotate_reference(k, ...)), new contiguous tensors.
    q: [T, H, D], k: [T, KVH, D] (head_dim contiguous); cos, sin_signed: [T or 1, 1, R]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, rot = k.shape[1], cos.shape[-1]
    if q.stride(2) != 1 or k.stride(2) != 1 or rot % 2 or rot > head_dim:
        raise ValueError("triton_rotate_qk needs a contiguous head_dim of q and k and an even rotary_dim <= it")
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                     device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    cos, sin_signed = rotary_rows(cos, num_tokens), rotary_rows(sin_signed, num_tokens)
    _rotate_qk_kernel[(num_tokens,)](
        q, k, q_out, k_out, cos, sin_signed,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), cos.stride(0), sin_signed.stride(0),
        NUM_HEADS=num_heads, Q_HEADS_POW2=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads, K_HEADS_POW2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim), ROT_DIM=rot,
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
    )
    return q_out, k_out
