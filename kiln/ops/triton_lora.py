"""Triton kernels behind ``kiln.add_lora`` on CUDA: punica's BGMV, shrink then expand by slot.

    shrink  grid (T, cdiv(R, BLOCK_R))   h[t, r] = sum_k x[t, k] * A[slot(t) - 1, r, k]   (float32)
    expand  grid (T, cdiv(N, BLOCK_N))   out[t, n] = y[t, n] + sum_r h[t, r] * B[slot(t) - 1, r, n]

Each program reads its token's slot from the step's slot table (a device tensor: nothing is read
on the host, so a CUDA graph captured once replays any mix of adapters); a base-model token (slot
0) reads no adapter weights and writes ``y`` through unchanged. The rank dimension is one block
(ranks are at most ``lora.max_lora_rank`` times the linear's slices), so expand sums it in
registers. ``check_against_reference`` compares the op with ``add_lora_reference`` on fresh random
inputs; ``kiln_triton::add_lora`` (the generic op's schema) is what ``kiln.ops.registry`` hands
``LoraBackendPass`` on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.lora import add_lora_reference, define_add_lora_op


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, K, R, stride_x, stride_as, stride_ar, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t, rb = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    used = slot > 0
    stack = tl.maximum(slot - 1, 0)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x + cols, mask=used & (cols < K), other=0.0).to(tl.float32)
        a = tl.load(a_ptr + stack * stride_as + rows[:, None] * stride_ar + cols[None, :],
                    mask=used & (rows[:, None] < R) & (cols[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * stride_h + rows, acc, mask=rows < R)


@triton.jit
def _expand_kernel(y_ptr, h_ptr, b_ptr, slots_ptr, out_ptr, N, R, stride_y, stride_h, stride_bs, stride_br,
                   stride_o, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t, nb = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    used = slot > 0
    stack = tl.maximum(slot - 1, 0)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + t * stride_h + ranks, mask=used & (ranks < R), other=0.0)
    b = tl.load(b_ptr + stack * stride_bs + ranks[:, None] * stride_br + cols[None, :],
                mask=used & (ranks[:, None] < R) & (cols[None, :] < N), other=0.0).to(tl.float32)
    delta = tl.sum(h[:, None] * b, axis=0)  # [BLOCK_N]
    y = tl.load(y_ptr + t * stride_y + cols, mask=cols < N, other=0.0)
    tl.store(out_ptr + t * stride_o + cols, (y.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=cols < N)


def triton_add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_slots: torch.Tensor) -> torch.Tensor:
    """``add_lora_reference``'s contract: y [T, out], x [T, in], lora_a [S, R, in], lora_b [S, R, out]."""
    num_tokens, out_features = y.shape
    rank, in_features = lora_a.shape[1], lora_a.shape[2]
    out = torch.empty_like(y)
    if num_tokens == 0:
        return out
    x, lora_a, lora_b = x.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    block_r = min(triton.next_power_of_2(rank), 64)
    _shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, lora_a, token_slots, h, in_features, rank, x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0),
        BLOCK_R=block_r, BLOCK_K=128)
    block_n = 64
    _expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        y, h, lora_b, token_slots, out, out_features, rank, y.stride(0), h.stride(0), lora_b.stride(0),
        lora_b.stride(1), out.stride(0), BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=block_n)
    return out


add_lora = define_add_lora_op("kiln_triton::add_lora", triton_add_lora)


def check_against_reference(num_tokens: int, in_features: int, out_features: int, rank: int, num_slots: int,
                            dtype: torch.dtype, device: str, seed: int = 0) -> float:
    """Relative L2 error of the kernels against ``add_lora_reference`` on fresh random inputs, with
    tokens of every slot and of the base model (slot 0) mixed."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    y, x = randn(num_tokens, out_features), randn(num_tokens, in_features)
    a, b = randn(num_slots, rank, in_features), randn(num_slots, rank, out_features)
    slots = torch.randint(0, num_slots + 1, (num_tokens,), generator=gen, device=device, dtype=torch.int32)
    got, want = triton_add_lora(y, x, a, b, slots), add_lora_reference(y, x, a, b, slots)
    base = slots == 0
    if base.any() and not torch.equal(got[base], y[base]):
        return float("inf")  # a base-model token must come back exactly
    return ((got.double() - want.double()).norm() / want.double().norm()).item()
