"""Triton kernels behind ``kiln.add_lora`` on CUDA: shrink then expand over token tiles, by slot.

    shrink  grid (tiles, S, R blocks * SPLIT_K)   part[sp, t, r] = sum_{k in split sp} x[t, k] * A[s, r, k]
    expand  grid (tiles, S + 1, column blocks)     out[t, n] = y[t, n] + sum_sp,r part[sp, t, r] * B[s, r, n]

A program (m, s, ...) takes the tokens of tile m (BLOCK_T consecutive tokens of the step) whose
slot is s + 1 (shrink) or s (expand), and exits at once when the tile holds none: adapter s's
weights are read once per tile for all its tokens there (one ``tl.dot``), not once per token,
and a base-model token (slot 0) reads no adapter weights. Tokens are taken in the step's order,
without sorting them by slot: the slots are the same for the 128 calls of a step, so a sort per
call would add kernels to every call; requests' tokens are contiguous in a step (a prefill's
tile holds one adapter) and a decode batch's tiles hold each adapter at most once per tile.

The shrink splits K across SPLIT_K programs (enough programs when the step has few tokens) and
each writes its own float32 partial: nothing is zeroed and no atomics are needed; the expand sums
the partials of its tokens' ranks. Expand program (m, s, nb) covers columns of one slice j of the
fused linear (``slice_sizes``; a column block never crosses a slice) and reads only B's rank rows
j*R..(j+1)*R; program (m, 0, nb) copies the tile's base-model tokens' y.

``kiln_triton::expand_lora`` is the expand alone, for a linear that computed the shrink itself
(``kiln.ops.lora``'s joined layout): one launch a call (PDL where ``kiln.ops.pdl`` allows), grid
(tiles, column blocks); a program reads its tile's y columns once, adds its tokens' terms and
writes the block. Above ``EVERY_SLOT_MIN_TOKENS`` tokens the terms are one dot over every slot's
rank rows of the block's slice, h masked to each token's own slot (a decode batch of 8 adapters:
one pass of independent loads, not 8 dependent ones); at fewer, slot by slot over the slots the
tile holds. A tile of base-model tokens is a copy.

Every choice (tile, split, blocks) is a function of the shapes only, so a CUDA graph captured once
replays any mix of adapters. ``check_against_reference`` compares the op with
``add_lora_reference`` on fresh random inputs; ``kiln_triton::add_lora`` (the generic op's schema)
is what ``kiln.ops.registry`` hands ``LoraBackendPass`` on CUDA.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.ops.lora import (add_lora_reference, define_add_lora_op, define_expand_lora_op, expand_lora_reference,
                           slice_rank)
from kiln.ops.pdl import pdl_args

MAX_SLICES = 4  # slice boundaries travel as scalar arguments (fused linears have at most 3 slices)
TARGET_PROGRAMS = 256  # about two programs per SM of an H100/H200 for the shrink's K split
MAX_SPLIT_K = 8  # every expand program sums all the partials of its rows: more splits cost it more than they save
BLOCK_K = 64
BLOCK_N = 64
# The expand's one dot over every slot's ranks (B of every slot read, independent loads) above this
# many tokens, where a tile holds many adapters; slot by slot below (a decode token reads one B).
EVERY_SLOT_MIN_TOKENS = 16
MAX_EVERY_SLOT_RANKS = 256  # slots * rank rows of one such dot (B's tile: at most 256 x BLOCK_N)


@triton.jit
def _tile_rows(slots_ptr, T, slot, BLOCK_T: tl.constexpr):
    """Tile program_id(0)'s token indices and which of them have ``slot``."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_slot = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    return rows.to(tl.int64), tok_slot == slot


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, part_ptr, T, K, RR, k_per_split, num_r_blocks,
                   stride_x, stride_as, stride_ar, stride_ps, stride_pt,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    s = tl.program_id(1)
    rb, sp = tl.program_id(2) % num_r_blocks, tl.program_id(2) // num_r_blocks
    rows, mine = _tile_rows(slots_ptr, T, s + 1, BLOCK_T)
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        ranks = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        a_base = a_ptr + s.to(tl.int64) * stride_as + ranks[None, :] * stride_ar
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        k_lo = sp * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                        mask=mine[:, None] & (cols[None, :] < k_hi), other=0.0)  # [BLOCK_T, BLOCK_K]
            a = tl.load(a_base + cols[:, None], mask=(cols[:, None] < k_hi) & (ranks[None, :] < RR),
                        other=0.0)  # [BLOCK_K, BLOCK_R]
            acc = tl.dot(x.to(a.dtype), a, acc, input_precision=DOT_PRECISION)
        tl.store(part_ptr + sp * stride_ps + rows[:, None] * stride_pt + ranks[None, :], acc,
                 mask=mine[:, None] & (ranks[None, :] < RR))


@triton.jit
def _slice_of_block(nb, N, n_end0, n_end1, n_end2, b_end0, b_end1, b_end2, BLOCK_N: tl.constexpr):
    """Column block ``nb`` -> (slice j, its first column, the slice's end column)."""
    j = (nb >= b_end0).to(tl.int32) + (nb >= b_end1).to(tl.int32) + (nb >= b_end2).to(tl.int32)
    n_start = tl.where(j == 0, 0, tl.where(j == 1, n_end0, tl.where(j == 2, n_end1, n_end2)))
    b_start = tl.where(j == 0, 0, tl.where(j == 1, b_end0, tl.where(j == 2, b_end1, b_end2)))
    n_stop = tl.where(j == 0, n_end0, tl.where(j == 1, n_end1, tl.where(j == 2, n_end2, N)))
    return j, n_start + (nb - b_start) * BLOCK_N, n_stop


@triton.jit
def _expand_kernel(y_ptr, part_ptr, b_ptr, slots_ptr, out_ptr, T, N, R,
                   n_end0, n_end1, n_end2, b_end0, b_end1, b_end2,
                   stride_y, stride_ps, stride_pt, stride_bs, stride_br, stride_o,
                   SPLIT_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    slot = tl.program_id(1)
    rows, mine = _tile_rows(slots_ptr, T, slot, BLOCK_T)
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        j, n0, n_stop = _slice_of_block(tl.program_id(2), N, n_end0, n_end1, n_end2, b_end0, b_end1, b_end2,
                                            BLOCK_N)
        cols = n0 + tl.arange(0, BLOCK_N)
        io_mask = mine[:, None] & (cols[None, :] < n_stop)
        y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=io_mask, other=0.0)
        res = y
        if slot > 0:
            ranks = tl.arange(0, BLOCK_R)
            h_ptrs = part_ptr + rows[:, None] * stride_pt + (j * R + ranks)[None, :]
            h_mask = mine[:, None] & (ranks[None, :] < R)
            h = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for sp in tl.static_range(SPLIT_K):
                h += tl.load(h_ptrs + sp * stride_ps, mask=h_mask, other=0.0)
            b = tl.load(b_ptr + (slot - 1).to(tl.int64) * stride_bs + (j * R + ranks)[:, None] * stride_br
                        + cols[None, :], mask=(ranks[:, None] < R) & (cols[None, :] < n_stop), other=0.0)
            delta = tl.dot(h.to(b.dtype), b, input_precision=DOT_PRECISION)  # [BLOCK_T, BLOCK_N]
            res = (y.to(tl.float32) + delta).to(y.dtype)
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], res, mask=io_mask)


@triton.jit
def _expand_joined_kernel(y_ptr, b_ptr, slots_ptr, out_ptr, T, N, R, RR, S,
                          n_end0, n_end1, n_end2, b_end0, b_end1, b_end2,
                          stride_y, stride_bs, stride_br, stride_o,
                          BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_S: tl.constexpr, EVERY_SLOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    # The slots and B are written before the step, never by the kernel before: read ahead of the wait.
    tok_slot = tl.load(slots_ptr + rows, mask=live, other=0)
    rows = rows.to(tl.int64)
    j, n0, n_stop = _slice_of_block(tl.program_id(1), N, n_end0, n_end1, n_end2, b_end0, b_end1, b_end2, BLOCK_N)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_stop
    if EVERY_SLOT:
        # One dot over every slot's ranks (column i: slot i // BLOCK_R, rank i % BLOCK_R), each
        # token's h masked to its own slot: a tile of many adapters in one pass of independent loads.
        i = tl.arange(0, BLOCK_S * BLOCK_R)
        slot_i, rank_i = i // BLOCK_R, i % BLOCK_R
        i_ok = (slot_i < S) & (rank_i < R)
        b = tl.load(b_ptr + slot_i[:, None].to(tl.int64) * stride_bs + (j * R + rank_i)[:, None] * stride_br
                    + cols[None, :], mask=i_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_S * BLOCK_R, BLOCK_N]
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=live[:, None] & col_ok[None, :],
                    other=0.0)
        h_mask = (tok_slot[:, None] == slot_i[None, :] + 1) & i_ok[None, :]
        h = tl.load(y_ptr + rows[:, None] * stride_y + (N + slot_i * RR + j * R + rank_i)[None, :], mask=h_mask,
                    other=0.0)  # [BLOCK_T, BLOCK_S * BLOCK_R]
        acc = tl.dot(h.to(b.dtype), b, y.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        # Few tokens: slot by slot, only the slots the tile holds (B read once per slot present).
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=live[:, None] & col_ok[None, :],
                    other=0.0)
        acc = y.to(tl.float32)  # [BLOCK_T, BLOCK_N]
        ranks = tl.arange(0, BLOCK_R)
        r_ok = ranks < R
        # slot s's h for slice j: y_ext columns N + s * RR + j * R ..
        h_ptrs = y_ptr + rows[:, None] * stride_y + (N + j * R + ranks)[None, :]
        b_ptrs = b_ptr + (j * R + ranks)[:, None] * stride_br + cols[None, :]
        for s in range(0, S):  # the pointers step one slot a time (h: RR columns, B: one stack row)
            mine = tok_slot == s + 1
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                h = tl.load(h_ptrs, mask=mine[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_R]
                b = tl.load(b_ptrs, mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
                acc = tl.dot(h.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
            h_ptrs += RR
            b_ptrs += stride_bs
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & col_ok[None, :])


def _split_k(num_tiles: int, num_tokens: int, num_slots: int, num_r_blocks: int, in_features: int) -> int:
    """Shrink programs per tile: a power of two giving about TARGET_PROGRAMS busy programs when the
    tiles hold min(tokens, slots) adapters, at most one BLOCK_K chunk per program."""
    busy = num_tiles * min(num_tokens, num_slots) * num_r_blocks
    split = triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, busy))
    chunks = triton.cdiv(in_features, BLOCK_K)
    return max(1, min(split, MAX_SPLIT_K, 1 << (chunks.bit_length() - 1)))


def _slice_bounds(slice_sizes: list[int]) -> tuple[list[int], list[int], int]:
    """Column ends and column-block ends of the slices but the last (padded to MAX_SLICES - 1 with
    the totals), and the number of column blocks."""
    if len(slice_sizes) > MAX_SLICES:
        raise ValueError(f"kiln_triton.add_lora: at most {MAX_SLICES} slices, got {list(slice_sizes)}")
    n_ends, b_ends, n, blocks = [], [], 0, 0
    for size in slice_sizes:
        n, blocks = n + size, blocks + triton.cdiv(size, BLOCK_N)
        n_ends.append(n)
        b_ends.append(blocks)
    pad = MAX_SLICES - len(slice_sizes)
    return n_ends[:-1] + [n] * pad, b_ends[:-1] + [blocks] * pad, blocks


def triton_add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    slice_sizes: list[int], token_slots: torch.Tensor) -> torch.Tensor:
    """``add_lora_reference``'s contract: y [T, out], x [T, in], lora_a [S, slices * R, in],
    lora_b [S, slices * R, out]."""
    num_tokens, out_features = y.shape
    num_slots, ranks, in_features = lora_a.shape
    rank = slice_rank(lora_a, lora_b, slice_sizes)
    y = y.contiguous()
    out = torch.empty_like(y)
    if num_tokens == 0:
        return out
    x, lora_a, lora_b = x.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    precision = "ieee" if lora_a.dtype == torch.float32 else "tf32"
    block_t = min(64, max(16, triton.next_power_of_2(num_tokens)))
    num_tiles = triton.cdiv(num_tokens, block_t)
    block_r = min(64, max(16, triton.next_power_of_2(ranks)))
    num_r_blocks = triton.cdiv(ranks, block_r)
    split_k = _split_k(num_tiles, num_tokens, num_slots, num_r_blocks, in_features)
    k_per_split = triton.cdiv(triton.cdiv(in_features, BLOCK_K), split_k) * BLOCK_K
    part = torch.empty(split_k, num_tokens, ranks, dtype=torch.float32, device=x.device)  # [SPLIT_K, T, slices * R]
    _shrink_kernel[(num_tiles, num_slots, num_r_blocks * split_k)](
        x, lora_a, token_slots, part, num_tokens, in_features, ranks, k_per_split, num_r_blocks,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), part.stride(0), part.stride(1),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=BLOCK_K, DOT_PRECISION=precision)
    n_ends, b_ends, num_col_blocks = _slice_bounds(slice_sizes)
    _expand_kernel[(num_tiles, num_slots + 1, num_col_blocks)](
        y, part, lora_b, token_slots, out, num_tokens, out_features, rank, *n_ends, *b_ends,
        y.stride(0), part.stride(0), part.stride(1), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        SPLIT_K=split_k, BLOCK_T=block_t, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_N=BLOCK_N,
        DOT_PRECISION=precision)
    return out


add_lora = define_add_lora_op("kiln_triton::add_lora", triton_add_lora)


def triton_expand_lora(y_ext: torch.Tensor, lora_b: torch.Tensor, slice_sizes: list[int],
                       token_slots: torch.Tensor) -> torch.Tensor:
    """``expand_lora_reference``'s contract: y_ext [T, out + S * slices * R], lora_b [S, slices * R, out]."""
    num_tokens = y_ext.shape[0]
    num_slots, ranks, out_features = lora_b.shape
    if len(slice_sizes) == 0 or ranks % len(slice_sizes) or y_ext.shape[1] != out_features + num_slots * ranks:
        return expand_lora_reference(y_ext, lora_b, slice_sizes, token_slots)  # raises the shape error
    rank = ranks // len(slice_sizes)
    out = y_ext.new_empty((num_tokens, out_features))
    if num_tokens == 0:
        return out
    if y_ext.stride(1) != 1:
        y_ext = y_ext.contiguous()
    lora_b = lora_b.contiguous()
    block_t = min(64, max(16, triton.next_power_of_2(num_tokens)))
    block_r, block_s = max(16, triton.next_power_of_2(rank)), triton.next_power_of_2(num_slots)
    n_ends, b_ends, num_col_blocks = _slice_bounds(slice_sizes)
    _expand_joined_kernel[(triton.cdiv(num_tokens, block_t), num_col_blocks)](
        y_ext, lora_b, token_slots, out, num_tokens, out_features, rank, ranks, num_slots, *n_ends, *b_ends,
        y_ext.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_N=BLOCK_N, BLOCK_S=block_s,
        EVERY_SLOT=num_tokens > EVERY_SLOT_MIN_TOKENS and block_s * block_r <= MAX_EVERY_SLOT_RANKS,
        DOT_PRECISION="ieee" if lora_b.dtype == torch.float32 else "tf32", **pdl_args(y_ext))
    return out


expand_lora = define_expand_lora_op("kiln_triton::expand_lora", triton_expand_lora)


def check_against_reference(num_tokens: int, in_features: int, slice_sizes: list[int], rank: int, num_slots: int,
                            dtype: torch.dtype, device: str, seed: int = 0,
                            slots: Optional[torch.Tensor] = None) -> float:
    """Relative L2 error of the kernels against ``add_lora_reference`` on fresh random inputs (B
    random off its slices' blocks too, which neither may read), with ``slots`` (default: every
    slot and the base model's mixed at random); base-model tokens must come back exactly."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    out_features, ranks = sum(slice_sizes), len(slice_sizes) * rank
    y, x = randn(num_tokens, out_features), randn(num_tokens, in_features)
    a, b = randn(num_slots, ranks, in_features), randn(num_slots, ranks, out_features)
    if slots is None:
        slots = torch.randint(0, num_slots + 1, (num_tokens,), generator=gen, device=device, dtype=torch.int32)
    got = triton_add_lora(y, x, a, b, list(slice_sizes), slots)
    want = add_lora_reference(y, x, a, b, list(slice_sizes), slots)
    base = slots[:num_tokens] == 0
    if base.any() and not torch.equal(got[base], y[base]):
        return float("inf")  # a base-model token must come back exactly
    if base.all():
        return 0.0
    return ((got.double() - want.double()).norm() / (want.double() - y.double()).norm()).item()


def check_expand_against_reference(num_tokens: int, slice_sizes: list[int], rank: int, num_slots: int,
                                   dtype: torch.dtype, device: str, seed: int = 0,
                                   slots: Optional[torch.Tensor] = None) -> float:
    """``check_against_reference`` for ``triton_expand_lora`` (y_ext random, h columns included)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out_features, ranks = sum(slice_sizes), len(slice_sizes) * rank
    y_ext = torch.randn(num_tokens, out_features + num_slots * ranks, generator=gen, device=device).to(dtype)
    b = torch.randn(num_slots, ranks, out_features, generator=gen, device=device).to(dtype)
    if slots is None:
        slots = torch.randint(0, num_slots + 1, (num_tokens,), generator=gen, device=device, dtype=torch.int32)
    got = triton_expand_lora(y_ext, b, list(slice_sizes), slots)
    want = expand_lora_reference(y_ext, b, list(slice_sizes), slots)
    y = y_ext[:, :out_features]
    base = slots[:num_tokens] == 0
    if base.any() and not torch.equal(got[base], y[base]):
        return float("inf")  # a base-model token must come back exactly
    if base.all():
        return 0.0
    return ((got.double() - want.double()).norm() / (want.double() - y.double()).norm()).item()
