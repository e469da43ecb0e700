"""Triton kernel behind ``kiln.fused_moe`` on CUDA: tokens sorted by expert, two grouped GEMMs.

    1. align   (torch, no host sync)  the T*K (token, slot) pairs sorted by expert, each expert's run
                                      padded to a multiple of BLOCK_M with a sentinel; one expert
                                      id per BLOCK_M block; the padded total as a device scalar
    2. gate_up grid (blocks, cdiv(I, BLOCK_N))  per block: gather BLOCK_M rows of x, multiply by the
                                      block's expert's gate and up rows (two accumulators), write
                                      silu(gate) * up  -> inter [T*K, I]
    3. down    grid (blocks, cdiv(H, BLOCK_N))  per block: inter rows @ that expert's w2, scaled by
                                      the routing weight  -> out_k [T*K, H]
    4. sum     out_k.view(T, K, H).sum(1)

Every size is fixed by T, K, E and the block size: the number of padded rows is bounded by
``T*K + min(T*K, E) * (BLOCK_M - 1)``, the grids are launched at that bound and blocks past the
real padded total (read on the device) return at once. Nothing reads a device value on the host,
so the op records into CUDA graphs and replays for any routing. SiLU-and-mul is fused into the
first GEMM's epilogue, so the [T*K, 2I] gate/up activations never reach memory.

Numerics: float32 accumulation, silu and the product rounded to x's dtype as the reference does,
the routing weight multiplied in float32, the K-way sum in float32. float32 inputs use IEEE
matmuls (no TF32), so they match the reference to float32 rounding.

``check_against_reference`` compares it with ``kiln.ops.moe.fused_moe_reference`` on fresh random
inputs (tests, and ``python -m benchmarks.offline moe`` at real shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.moe import GENERIC_MOE_OP, check_moe_shapes, define_fused_moe_op, fused_moe_reference


def moe_block_config(num_tokens: int, top_k: int) -> dict[str, int]:
    """Tile sizes by batch: small blocks of rows for decode (most experts see one or two rows)."""
    rows = num_tokens * top_k
    if rows <= 64:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    if rows <= 1024:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted slot ids [max_padded], expert of each block [max_padded // block_m], padded total [1]).

    Slot s = t * K + k. Each expert's slots are contiguous and start at a multiple of ``block_m``;
    padding holds T * K, one past the last slot."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    device = flat.device
    max_padded = num_slots + min(num_slots, num_experts) * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without sizing by max() on the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    unpadded_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    expert_of = flat[order]
    rank = torch.arange(num_slots, device=device) - unpadded_start[expert_of]
    sorted_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, padded_start[expert_of] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    # Blocks past the padded total are never read (the kernels return first); clamped into range.
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


@triton.jit
def _block_pids(num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks share each column sweep (weights stay in L2)."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n_blocks
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr,
                        num_slots, inter, hidden, top_k, num_m_blocks,
                        stride_xm, stride_we, stride_wn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = _block_pids(num_m_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ids_ptr + offs_m)
    row_ok = slots < num_slots
    rows = (slots // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_base = w_ptr + expert * stride_we
    g_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = offs_k < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out_ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, (silu * up).to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, total_ptr,
                     num_slots, hidden, inter, num_m_blocks,
                     stride_am, stride_we, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = _block_pids(num_m_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ids_ptr + offs_m)
    row_ok = slots < num_slots
    slots64 = slots.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + slots64[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = offs_k < inter - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + slots64, mask=row_ok, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]  # the reference rounds the matmul, then scales
    out_ptrs = out_ptr + slots64[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def triton_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, K] -> [T, H]."""
    check_moe_shapes(x, w13, w2, topk_weights, topk_ids)
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        return fused_moe_reference(x, w13, w2, topk_weights, topk_ids)  # mixed dtypes: not for this kernel
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    cfg = moe_block_config(num_tokens, top_k)
    bm, bn, bk, group = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["GROUP_M"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    sorted_ids, block_expert, total = align_by_expert(topk_ids, num_experts, bm)
    num_slots = num_tokens * top_k
    num_m_blocks = block_expert.numel()
    ieee = x.dtype == torch.float32
    # A weight multiplies in its own dtype in the reference; float32 covers every input dtype exactly.
    weights = topk_weights.reshape(-1).to(torch.float32)
    inter_out = x.new_empty((num_slots, inter))
    _moe_gate_up_kernel[(num_m_blocks * triton.cdiv(inter, bn),)](
        x, w13, inter_out, sorted_ids, block_expert, total,
        num_slots, inter, hidden, top_k, num_m_blocks,
        x.stride(0), w13.stride(0), w13.stride(1), inter_out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, IEEE=ieee, **launch,
    )
    out_k = x.new_empty((num_slots, hidden))
    _moe_down_kernel[(num_m_blocks * triton.cdiv(hidden, bn),)](
        inter_out, w2, out_k, weights, sorted_ids, block_expert, total,
        num_slots, hidden, inter, num_m_blocks,
        inter_out.stride(0), w2.stride(0), w2.stride(1), out_k.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, IEEE=ieee, **launch,
    )
    return out_k.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


fused_moe = define_fused_moe_op("kiln_triton::fused_moe", triton_fused_moe)
# The generic op on CUDA tensors runs this kernel too: the reference's host sync would make eager
# and stock modes fail CUDA-graph capture.
torch.library.register_kernel(GENERIC_MOE_OP, "cuda", triton_fused_moe)


def random_moe_inputs(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                      dtype: torch.dtype, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Fresh (x, w13, w2, topk_weights, topk_ids) with softmax-top-k routing of random logits."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    x = randn(num_tokens, hidden)
    w13 = randn(num_experts, 2 * inter, hidden, std=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, std=inter**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    topk_weights, topk_ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, w13, w2, topk_weights, topk_ids


def check_against_reference(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                            dtype: torch.dtype, device: str, seed: int = 0) -> float:
    """Max abs error of the kernel against the grouped reference on fresh random inputs, relative to
    the reference's max abs value."""
    args = random_moe_inputs(num_tokens, hidden, inter, num_experts, top_k, dtype, device, seed)
    got = triton_fused_moe(*args).float()
    want = fused_moe_reference(*args).float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
