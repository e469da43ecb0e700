"""Triton paged attention over a mixed batch: ``torch.ops.kiln_triton.attend_paged``.

Reference: ``kiln.ops.attention.attend_paged_reference``; ``triton_attend_paged`` has its exact
signature and semantics (store the new K/V, then attend causally over each request's context).

Two kernels, one per phase of the flat batch (decodes first, then prefill chunks)::

    tokens: | d0 | d1 | d2 | p0 (cached prefix hit, q_len 5) | p1 (fresh, q_len 7) |
             \\_ decode kernel _/ \\______________ prefill kernel ______________/
             grid (decode, kv_head, split)   grid (query block, prefill, kv_head)

Both pack the query heads that share a kv head into the rows of one tile (GQA): a program loads
each K/V tile once per kv head, not once per query head. Rows are ``(query token, head in group)``;
for fp32/bf16/fp16 the scores and the online softmax are float32.

Why two kernels and not one: a decode step is memory bound (one query per request, every K/V byte
read once), so its programs must be spread over the *context* to fill the GPU when
``num_decodes * num_kv_heads`` is small: split-K (flash-decoding), each split writes a partial
output and its log-sum-exp, and a small reduce kernel merges the splits. A prefill chunk is compute
bound and already has parallelism across query blocks, so it needs no split, but it needs a causal
mask and wide query tiles for the tensor cores. Separate kernels let each keep its own tile shape
and launch width (``LaunchConfig``) without branches in the inner loop; they share the tile loader
and the online-softmax step.

K/V tiles are gathered token by token through the block table (``block_id * block_size + offset``),
so the tile width ``BLOCK_N`` is independent of the cache block size (any power of two).

The hot path does no host sync: grids come from the host ints of ``AttentionMetadata``
(``num_decodes``, ``max_query_len``, ``seq_lens_cpu``); every per-request number is read on device.
Split counts change with the context length, so this path is not CUDA-graph static by default.
Inside ``static_decode_splits(max_model_len)`` (what CUDA-graph capture uses) the decode split count
and split width come from that bound instead of the batch's contexts, so one captured launch is
valid for every context up to it: splits past a request's context are empty and merge as weight 0.

Sliding window and soft-cap (``sliding_window``, ``logit_softcap``; constexpr ``SLIDING`` /
``SOFTCAP``, so other models compile the kernels they always did): a windowed decode splits only
the last ``sliding_window`` keys; a windowed prefill tile starts at its first row's window and
masks both ends, a row that sees none of a tile keeping its state (``MAY_BE_EMPTY``). A head_dim
that is not a power of two is padded to one with masked loads and stores.

Rotary (``ROPE``, ``torch.ops.kiln_triton.attend_paged_rope``): where the decode kernel stores the
new K/V itself (a decode-only batch of at most ``kernels.max_store_join_pairs`` (decode, kv head) pairs;
a larger one runs faster with the store and rotary in launches of their own) it can also take q
and k before their rotary and rotate them as it loads them
(rotate-half over the first ``ROT_DIM`` dims, from the model's per-token cos/sin rows), which
saves the model's rotary kernel a layer; other batches are rotated first (``kiln.ops.triton_rotary``).

``torch.ops.kiln_triton.attend_paged`` has the schema of ``kiln::attend_paged`` (the op the
compiler swaps in on CUDA); ``kiln.ops.registry`` selects it, with ``static_decode_splits`` as the
context CUDA-graph capture enters.

Correctness check: ``check_against_reference`` below (used by ``tests/ops/test_triton_attention.py``
and ``python -m benchmarks.kernels attention --check``); timing: ``python -m benchmarks.kernels attention``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import triton
import triton.language as tl

from kiln.forward_context import AttentionMetadata
from kiln.ops.attention import (attend_paged_reference, attend_paged_rope_reference, define_attention_op,
                                define_rope_attention_op, fp8_kv_scale)
from kiln.ops.options import current
from kiln.ops.paged_batch import PagedBatch, PagedBatchSpec, random_paged_batch  # noqa: F401  (checks and tests)
from kiln.ops.pdl import pdl_args
from kiln.ops.triton_kv_store import triton_store_kv
from kiln.ops.triton_rotary import rotary_rows, triton_rotate_qk

LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shapes and launch widths. Defaults: best of ``python -m benchmarks.kernels attention --sweep`` on
    Hopper (H200) at llama3-8b shapes (bf16, head_dim 128)."""

    decode_block_n: int = 64  # keys per decode tile
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    # Registers a thread of the decode kernel over an FP8 cache on a grid that fills the card
    # (``decode_maxnreg``); None leaves them to the compiler
    fp8_decode_maxnreg: Optional[int] = 96
    min_split_tokens: int = 256  # never split a decode context finer than this
    # ... except inside static_decode_splits (CUDA graphs): there the split width comes from
    # max_model_len, not the context, so at batch 1 wide splits leave one program per kv head looping
    # over the whole context while the others are empty; narrow ones spread it over the SMs.
    static_min_split_tokens: int = 64
    programs_per_sm: int = 2  # split decodes until the grid has about this many programs per SM
    prefill_block_m: int = 64  # rows per prefill tile: query tokens x heads of one kv head
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2


# ---------------------------------------------------------------------------------------------
# Shared pieces of the two kernels


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, offs_n, key_ok, kv_head, d, d_ok,
                  stride_cb, stride_cs, stride_ch, PAGE_SIZE: tl.constexpr, EVEN_D: tl.constexpr = False):
    """Gather keys ``offs_n`` of one request: K transposed [HEAD_DIM, BLOCK_N], V [BLOCK_N, HEAD_DIM]
    (``HEAD_DIM`` a power of two; dims where ``d_ok`` is false read as 0)."""
    block_ids = tl.load(table_ptr + offs_n // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = block_ids * stride_cb + (offs_n % PAGE_SIZE) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
    if EVEN_D:  # head_dim is a power of two: only the keys need a mask (no per-element mask of d)
        k_t = tl.load(k_cache_ptr + slot[None, :] + d[:, None], mask=key_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
    else:
        k_t = tl.load(k_cache_ptr + slot[None, :] + d[:, None], mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    return k_t, v


@triton.jit
def _scores(q, k_t, qk_scale, cap_log2, inv_cap, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Log2-scaled scores of a tile [BLOCK_M, BLOCK_N]. Without a soft-cap ``qk_scale`` is
    scale * log2(e); with one it is the scale, and the scores become cap * tanh(s / cap) in base 2
    (tanh(x) = 2 sigmoid(2x) - 1: the interpreter has no tanh)."""
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        s = cap_log2 * (2.0 * tl.sigmoid(2.0 * s * inv_cap) - 1.0)
    return s


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, MAY_BE_EMPTY: tl.constexpr = False):
    """Fold one tile of log2-scaled scores ``s`` [BLOCK_M, BLOCK_N] (masked keys at -inf) into the
    running max ``m_i``, denominator ``l_i`` and unnormalised output ``acc``. Without
    ``MAY_BE_EMPTY`` every row must have seen an unmasked key by the end of this step, so ``m_new``
    is finite; with it (sliding windows) a row that has seen none keeps l_i = 0 and acc = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# ---------------------------------------------------------------------------------------------
# Decode: one query token per request, split-K over the context


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, cap_log2, inv_cap, window, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt, split_tokens,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRESCALE_Q: tl.constexpr = False, kv_scale_ptr=None, KV_SCALED: tl.constexpr = False,
    k_new_ptr=None, v_new_ptr=None, slot_mapping_ptr=None, stride_kt=0, stride_kh=0, stride_vt=0, stride_vh=0,
    FUSED_STORE: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    counters_ptr=None, FUSED_MERGE: tl.constexpr = False, SPLITS_POW2: tl.constexpr = 1,
    cos_ptr=None, sin_ptr=None, stride_cos=0, stride_sin=0, ROPE: tl.constexpr = False, ROT_DIM: tl.constexpr = 0,
):
    if USE_PDL:  # kiln.ops.pdl
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    if SLIDING:  # the query (position seq_len - 1) sees the last `window` keys: the splits cover those
        kv_base = tl.maximum(seq_len - window, 0)
    else:
        kv_base = 0
    kv_start = kv_base + split * split_tokens
    kv_end = tl.minimum(kv_start + split_tokens, seq_len)
    if FUSED_MERGE:
        # Only the splits that hold keys take part: the others leave at once, and a context that
        # fits one split is written by that split alone, with no partials and no count.
        live = tl.maximum(tl.cdiv(seq_len - kv_base, split_tokens), 1)
        if split >= live:
            return

    rows = tl.arange(0, BLOCK_M)  # row r is query head kv_head * GROUP + r
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q_ptrs = q_ptr + req * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if ROPE:
        # q and the new key arrive before their rotary (rotate-half over the first ROT_DIM dims, the
        # rest pass through): x * cos + x[partner] * [-sin, sin] in fp32, rounded to x's dtype as
        # the model's own rotary kernel would have stored it. Needs FUSED_STORE (a decode-only batch).
        r_ok = d < ROT_DIM
        partner = tl.where(r_ok, (d + ROT_DIM // 2) % ROT_DIM, d)
        cos = tl.load(cos_ptr + req * stride_cos + d, mask=r_ok, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + req * stride_sin + d, mask=r_ok, other=0.0).to(tl.float32)
        q_pair = tl.load(q_ptr + req * stride_qt + heads[:, None] * stride_qh + partner[None, :],
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q = (q.to(tl.float32) * cos[None, :] + q_pair.to(tl.float32) * sin[None, :]).to(q_ptr.dtype.element_ty)
    if KV_SCALED:  # FP8 cache scales: k_scale joins the score scale, v_scale the output
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    if PRESCALE_Q:  # the score scale goes into q before its cast (see _dot_args)
        q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
        qk_scale = 1.0
    else:
        q = q.to(DOT_DTYPE)

    if FUSED_STORE:
        # The new key and value (position seq_len - 1) come from k/v, not the cache; the split that
        # holds that position stores them in their slot after its loop (triton_store_kv's work).
        last = seq_len - 1
        k_new = tl.load(k_new_ptr + req * stride_kt + kv_head * stride_kh + d, mask=d_ok, other=0.0)
        v_new = tl.load(v_new_ptr + req * stride_vt + kv_head * stride_vh + d, mask=d_ok, other=0.0)
        if ROPE:
            k_pair = tl.load(k_new_ptr + req * stride_kt + kv_head * stride_kh + partner, mask=d_ok, other=0.0)
            k_new = (k_new.to(tl.float32) * cos + k_pair.to(tl.float32) * sin).to(k_new_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < kv_end
        k_t, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, offs_n, key_ok, kv_head, d, d_ok,
                               stride_cb, stride_cs, stride_ch, PAGE_SIZE, HEAD_DIM == HEAD_DIM_P2)
        if FUSED_STORE:
            is_new = offs_n == last
            k_t = tl.where(is_new[None, :], k_new.to(k_t.dtype)[:, None], k_t)
            v = tl.where(is_new[:, None], v_new.to(v.dtype)[None, :], v)
        s = _scores(q, k_t.to(DOT_DTYPE), qk_scale, cap_log2, inv_cap, SOFTCAP, DOT_PRECISION)
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v.to(DOT_DTYPE), m_i, l_i, acc, DOT_PRECISION)
    if FUSED_STORE:
        if (last >= kv_start) & (last < kv_end):
            slot = tl.load(slot_mapping_ptr + req).to(tl.int64)
            dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs + kv_head * stride_ch + d
            tl.store(k_cache_ptr + dst, k_new.to(k_cache_ptr.dtype.element_ty), mask=d_ok)
            tl.store(v_cache_ptr + dst, v_new.to(v_cache_ptr.dtype.element_ty), mask=d_ok)

    if KV_SCALED:
        acc = acc * tl.load(kv_scale_ptr + 1)
    if SINGLE_SPLIT:
        o = acc / l_i[:, None]
        tl.store(out_ptr + req * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    elif FUSED_MERGE:
        # An empty context (a padding row's seq_len 0) leaves l_i = 0 and writes zeros.
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        if live == 1:
            tl.store(out_ptr + req * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
            num_splits = tl.num_programs(2)
            part = (req * (tl.num_programs(1) * GROUP) + heads) * num_splits + split  # [nd, H, splits]
            tl.store(part_lse_ptr + part, lse, mask=row_ok)
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
            # The last live split to finish merges them all (_merge_heads), then re-arms the counter
            # for the next launch. The barrier puts every thread's partial stores before the count.
            tl.debug_barrier()
            counter = counters_ptr + req * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == live - 1:
                _merge_heads(part_out_ptr, part_lse_ptr, out_ptr, req, kv_head * GROUP, num_splits, live,
                             stride_ot, stride_oh, tl.num_programs(1) * GROUP, GROUP, HEAD_DIM, HEAD_DIM_P2,
                             SPLITS_POW2)
                tl.atomic_xchg(counter, 0, sem="relaxed")
    else:
        # An empty split (past this request's context) leaves l_i = 0: it stores lse = -inf, o = 0.
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        num_splits = tl.num_programs(2)
        part = (req * (tl.num_programs(1) * GROUP) + heads) * num_splits + split  # [nd, H, splits]
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_heads(part_out_ptr, part_lse_ptr, out_ptr, req, first_head, num_splits, live, stride_ot, stride_oh,
                 num_heads, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                 SPLITS_POW2: tl.constexpr):
    """out[req, h] for the GROUP heads from first_head: the first ``live`` splits' partials merged
    as _merge_splits_kernel does. Partials are read from L2 (``.cg``): other SMs wrote them."""
    splits = tl.arange(0, SPLITS_POW2)
    ok = splits < live
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    for r in tl.static_range(GROUP):
        head = first_head + r
        part = (req * num_heads + head) * num_splits + splits
        lse = tl.load(part_lse_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp2(lse - tl.max(lse, 0))
        o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0, cache_modifier=".cg")
        o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + req * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, SPLITS_POW2: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    """out[req, head] = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    ok = splits < num_splits
    part = (req * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # the last key's split is never empty, so the max is finite
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + req * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


# ---------------------------------------------------------------------------------------------
# Prefill: chunks of BLOCK_Q query tokens, causal over cached prefix + the chunk itself


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    qk_scale, cap_log2, inv_cap, window, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt, first_req,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRESCALE_Q: tl.constexpr = False, kv_scale_ptr=None, KV_SCALED: tl.constexpr = False,
):
    q_block, kv_head = tl.program_id(0), tl.program_id(2)
    req = first_req + tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # the grid is sized for the longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = seq_len - q_len  # context position of the chunk's first query

    rows = tl.arange(0, BLOCK_M)  # row r is (query token r // GROUP, head kv_head * GROUP + r % GROUP)
    tok = q_block * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    # Rows past the chunk get q_pos >= seq_len: they see key 0 like every row, so no row is all -inf.
    q_pos = ctx_start + tok
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if KV_SCALED:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    if PRESCALE_Q:
        q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
        qk_scale = 1.0
    else:
        q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_end = tl.minimum(ctx_start + (q_block + 1) * BLOCK_Q, seq_len)  # last query's position + 1
    if SLIDING:
        # Keys from the first row's window start on, each tile masked both ways: a row may see none
        # of a tile (its window starts later), hence MAY_BE_EMPTY.
        kv_lo = tl.maximum(ctx_start + q_block * BLOCK_Q - window + 1, 0) // BLOCK_N * BLOCK_N
        for start in range(kv_lo, kv_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            key_ok = offs_n < kv_end
            k_t, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, offs_n, key_ok, kv_head, d, d_ok,
                                   stride_cb, stride_cs, stride_ch, PAGE_SIZE, HEAD_DIM == HEAD_DIM_P2)
            s = _scores(q, k_t.to(DOT_DTYPE), qk_scale, cap_log2, inv_cap, SOFTCAP, DOT_PRECISION)
            seen = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(key_ok[None, :] & seen, s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, v.to(DOT_DTYPE), m_i, l_i, acc, DOT_PRECISION, True)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past the chunk may see no key: 0, not 0 / 0
    else:
        # Keys below the tile's first query position are visible to every row: no mask in that loop.
        kv_full_end = (ctx_start + q_block * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
        for start in range(0, kv_full_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k_t, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, offs_n, offs_n < kv_full_end, kv_head, d,
                                   d_ok, stride_cb, stride_cs, stride_ch, PAGE_SIZE, HEAD_DIM == HEAD_DIM_P2)
            s = _scores(q, k_t.to(DOT_DTYPE), qk_scale, cap_log2, inv_cap, SOFTCAP, DOT_PRECISION)
            m_i, l_i, acc = _online_softmax_step(s, v.to(DOT_DTYPE), m_i, l_i, acc, DOT_PRECISION)
        for start in range(kv_full_end, kv_end, BLOCK_N):  # the diagonal: causal mask
            offs_n = start + tl.arange(0, BLOCK_N)
            key_ok = offs_n < kv_end
            k_t, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, offs_n, key_ok, kv_head, d, d_ok,
                                   stride_cb, stride_cs, stride_ch, PAGE_SIZE, HEAD_DIM == HEAD_DIM_P2)
            s = _scores(q, k_t.to(DOT_DTYPE), qk_scale, cap_log2, inv_cap, SOFTCAP, DOT_PRECISION)
            s = tl.where(key_ok[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, v.to(DOT_DTYPE), m_i, l_i, acc, DOT_PRECISION)

    if KV_SCALED:
        acc = acc * tl.load(kv_scale_ptr + 1)
    o = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Host side


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number exercises the split path the same way
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_decode_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int, cfg: LaunchConfig,
                      static: bool = False) -> int:
    """Split each decode context until the grid has ~programs_per_sm programs per SM, but keep at
    least ``min_split_tokens`` keys per split (``static_min_split_tokens`` for static splits) so the
    merge stays cheap."""
    want = triton.cdiv(cfg.programs_per_sm * num_sms, num_decodes * num_kv_heads)
    min_split = cfg.static_min_split_tokens if static else cfg.min_split_tokens
    return max(1, min(want, triton.cdiv(max_seq_len, min_split)))


def _kernel_args(q, kv_cache, meta, out, kv_scale=None) -> dict:
    """Pointer and stride arguments shared by the decode and prefill kernels."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    kv_scale = fp8_kv_scale(kv_cache, kv_scale)
    return dict(
        kv_scale_ptr=kv_scale, KV_SCALED=kv_scale is not None,
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_tables_ptr=meta.block_tables,
        seq_lens_ptr=meta.seq_lens, out_ptr=out,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_cb=k_cache.stride(0), stride_cs=k_cache.stride(1), stride_ch=k_cache.stride(2),
        stride_bt=meta.block_tables.stride(0),
    )


_static_max_seq_len: Optional[int] = None  # set only inside static_decode_splits()

# One int32 a (decode, kv head) that the decode kernel's fused merge counts split arrivals in; every
# launch leaves it at zero. Allocated once per device and never freed or grown, because CUDA graphs
# keep its address. A batch with more (decode, kv head) pairs merges in the separate kernel.
MERGE_COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def _merge_counters(device: torch.device, needed: int) -> Optional[torch.Tensor]:
    """The device's merge counters, or None where the separate merge kernel runs instead: more
    pairs than counters, ``kernels.decode_merge=kernel`` (to measure), or the first need arising
    inside a CUDA-graph capture (allocating there would tie the counters to the graph's pool)."""
    if needed > MERGE_COUNTERS or current().decode_merge == "kernel":
        return None
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _counters[device] = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
    return counters


@contextlib.contextmanager
def static_decode_splits(max_seq_len: int) -> Iterator[None]:
    """Size decode splits for contexts up to ``max_seq_len`` (not the batch's): launches made in
    this scope read no per-batch host value, so a CUDA graph captured here replays for any batch
    whose contexts stay within the bound. Refuses nesting."""
    global _static_max_seq_len
    if _static_max_seq_len is not None:
        raise RuntimeError("static_decode_splits is already active")
    _static_max_seq_len = max_seq_len
    try:
        yield
    finally:
        _static_max_seq_len = None


def _score_args(q, scale: float, sliding_window: int, logit_softcap: float) -> dict:
    """Scale, soft-cap and window arguments shared by the decode and prefill kernels."""
    head_dim = q.shape[2]
    softcap = logit_softcap > 0
    return dict(qk_scale=scale if softcap else scale * LOG2_E, cap_log2=logit_softcap * LOG2_E,
                inv_cap=1.0 / logit_softcap if softcap else 0.0, window=sliding_window,
                HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim),
                SLIDING=sliding_window > 0, SOFTCAP=softcap)


def _launch_decodes(q, kv_cache, meta, scale, out, cfg: LaunchConfig, sliding_window=0, logit_softcap=0.0,
                    kv_scale=None, new_kv=None, rope=None) -> None:
    """``new_kv``: (k, v) of a decode-only batch whose new keys are not yet stored (a cache of k's
    dtype): the decode kernel stores them and reads them from registers (one launch fewer a layer).
    ``rope``: (cos, sin_signed) [nd, 1, rotary_dim], last dim contiguous, with ``new_kv`` only: q and
    the new k are not yet rotated and the kernel rotates them (the model's rotary kernel fewer)."""
    nd = meta.num_decodes
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    max_len = _static_max_seq_len or max(meta.seq_lens_cpu[:nd])
    if sliding_window:
        max_len = min(max_len, sliding_window)  # keys a decode reads, from its window's start
    num_splits = num_decode_splits(nd, num_kv_heads, max_len, _num_sms(q.device), cfg,
                                   static=_static_max_seq_len is not None)
    split_tokens = triton.cdiv(triton.cdiv(max_len, num_splits), cfg.decode_block_n) * cfg.decode_block_n
    num_splits = triton.cdiv(max_len, split_tokens)
    single = num_splits == 1
    part_out = out if single else q.new_empty((nd, num_heads, num_splits, head_dim), dtype=torch.float32)
    part_lse = out if single else q.new_empty((nd, num_heads, num_splits), dtype=torch.float32)
    counters = None if single else _merge_counters(q.device, nd * num_kv_heads)
    store = {}
    if new_kv is not None:
        k, v = new_kv
        store = dict(k_new_ptr=k, v_new_ptr=v, slot_mapping_ptr=meta.slot_mapping, stride_kt=k.stride(0),
                     stride_kh=k.stride(1), stride_vt=v.stride(0), stride_vh=v.stride(1), FUSED_STORE=True)
    if rope is not None:
        if new_kv is None:
            raise ValueError("the decode kernel rotates q and k only where it stores the new k (new_kv)")
        cos, sin_signed = rope
        store.update(cos_ptr=cos, sin_ptr=sin_signed, stride_cos=cos.stride(0), stride_sin=sin_signed.stride(0),
                     ROPE=True, ROT_DIM=cos.shape[-1])
    maxnreg = decode_maxnreg(cfg, kv_cache, nd * num_kv_heads, _num_sms(q.device))
    _decode_kernel[(nd, num_kv_heads, num_splits)](
        **_kernel_args(q, kv_cache, meta, out, kv_scale), part_out_ptr=part_out, part_lse_ptr=part_lse,
        split_tokens=split_tokens, **_score_args(q, scale, sliding_window, logit_softcap),
        GROUP=group, PAGE_SIZE=kv_cache.shape[2],
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.decode_block_n, SINGLE_SPLIT=single,
        **_dot_args(q, kv_cache), num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages,
        **store, **pdl_args(q), counters_ptr=counters, FUSED_MERGE=counters is not None,
        SPLITS_POW2=triton.next_power_of_2(num_splits), **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    if not single and counters is None:
        _merge_splits_kernel[(nd, num_heads)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim),
            SPLITS_POW2=triton.next_power_of_2(num_splits), num_warps=4 if head_dim >= 128 else 2, **pdl_args(q),
        )


# Programs of the decode kernel over an FP8 cache that share an SM with the compiler's own register
# use: about 160 registers a thread (4 warps, 64-key tiles, head_dim 128) leave room for 3.
UNCAPPED_DECODE_PROGRAMS_PER_SM = 3


def decode_maxnreg(cfg: LaunchConfig, kv_cache: torch.Tensor, num_pairs: int, num_sms: int) -> Optional[int]:
    """The register cap of a decode launch over an FP8 cache whose ``num_pairs`` (decode, kv head)
    pairs alone are more programs than the card holds at the compiler's registers, else None.

    At 512 decodes of 257-512 keys (random:llama3-8b's shapes, an H200) the kernel over an FP8
    cache read 1.9 TB/s where bf16's reads 3.7: as long as bf16's over half the bytes, so the reads
    are not what bounds it. More programs in flight helped: the compiler gives a thread about 160
    registers (3 programs an SM); capped at 96 (a 24-byte stack frame) 5 share an SM and the kernel
    took 187 us a layer against 208 (128 registers, 4 programs: 187; 80, with more spills: 220).
    More pipeline stages (2 to 4 K/V buffers a program: 203-229 us) and widening V in registers
    (more registers, 282 us) did not pay. Applied at every size the cap made batch 1 slower
    (random:llama3-8b 350 against 356 tok/s, random:qwen2.5-0.5b 1,037 against 1,080), so a launch
    of at most that many pairs keeps the compiler's registers (2-49 decodes of llama3-8b were not
    measured either way).
    ``kernels.fp8_decode_maxnreg`` overrides the cap (0: none), to measure."""
    if kv_cache.element_size() != 1 or not kv_cache.is_cuda:
        return None
    if num_pairs <= UNCAPPED_DECODE_PROGRAMS_PER_SM * num_sms:
        return None
    over = current().fp8_decode_maxnreg
    return (over if over is not None else cfg.fp8_decode_maxnreg) or None


def _launch_prefills(q, kv_cache, meta, scale, out, cfg: LaunchConfig, sliding_window=0, logit_softcap=0.0,
                     kv_scale=None) -> None:
    num_prefills = meta.num_reqs - meta.num_decodes
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    group_pow2 = triton.next_power_of_2(group)
    block_q = max(1, cfg.prefill_block_m // group_pow2)
    block_m = max(16, block_q * group_pow2)
    grid = (triton.cdiv(meta.max_query_len, block_q), num_prefills, num_kv_heads)
    _prefill_kernel[grid](
        **_kernel_args(q, kv_cache, meta, out, kv_scale), query_start_loc_ptr=meta.query_start_loc,
        first_req=meta.num_decodes, **_score_args(q, scale, sliding_window, logit_softcap),
        GROUP=group, PAGE_SIZE=kv_cache.shape[2],
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=cfg.prefill_block_n,
        **_dot_args(q, kv_cache), num_warps=cfg.prefill_num_warps, num_stages=cfg.prefill_num_stages,
    )


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _dot_args(q: torch.Tensor, kv_cache: Optional[torch.Tensor] = None) -> dict:
    """Operand dtype and precision of the two ``tl.dot``s (accumulation is always fp32).

    fp32 inputs get exact fp32 products: tf32 would miss the 1e-4 tolerance. On CPU (Triton's
    interpreter) bf16 operands are upcast because the interpreter multiplies bf16 bit patterns as
    integers; on GPU 16-bit operands go to the tensor cores as they are.

    An FP8 (e4m3) cache with 16-bit queries on the GPU multiplies in fp16: e4m3 -> fp16 is one
    instruction per two values (e4m3 -> bf16 goes through fp16 and fp32, three), and with a 4-bit
    exponent and 3-bit mantissa every cached value is exact in fp16. Decode over an FP8 cache reads
    half the bytes of bf16, so without this the casts, not the reads, bound it. q is multiplied by
    the score scale in fp32 before its cast (``PRESCALE_Q``), so its fp16 range is the scores'
    (|q . k| * scale), not q's; the probabilities (0..1) lose nothing to fp16 that bf16 keeps.
    """
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        return dict(DOT_DTYPE=tl.float32, DOT_PRECISION="ieee")
    if (kv_cache is not None and kv_cache.dtype == torch.float8_e4m3fn and q.device.type == "cuda"
            and q.dtype in (torch.bfloat16, torch.float16)):
        return dict(DOT_DTYPE=tl.float16, DOT_PRECISION="tf32", PRESCALE_Q=True)
    return dict(DOT_DTYPE=_TL_DTYPES[q.dtype], DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def attend_paged_cached(q, kv_cache, meta: AttentionMetadata, scale: float, out, cfg: LaunchConfig = LaunchConfig(),
                        sliding_window: int = 0, logit_softcap: float = 0.0, *, kv_scale=None, new_kv=None, rope=None):
    """Attention only (the new K/V must already be in ``kv_cache``, unless ``new_kv`` gives them
    for a decode-only batch, which ``rope`` may also rotate: see ``_launch_decodes``); writes every
    row of ``out``.
    ``kv_scale``: an FP8 cache's [2] float32 (k_scale, v_scale), read on the device.
    A head_dim that is not a power of two (Phi-3's 96) is padded to one inside the kernels."""
    head_dim = q.shape[2]
    if not 16 <= head_dim <= 256 or q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError(f"Triton attention needs a contiguous head_dim of 16..256, got {head_dim}")
    if q.shape[1] % kv_cache.shape[3] != 0:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if sliding_window < 0 or logit_softcap < 0:
        raise ValueError("sliding_window and logit_softcap must be >= 0 (0: off)")
    if meta.num_decodes > 0:
        _launch_decodes(q, kv_cache, meta, scale, out, cfg, sliding_window, logit_softcap, kv_scale, new_kv, rope)
    if meta.num_decodes < meta.num_reqs:
        _launch_prefills(q, kv_cache, meta, scale, out, cfg, sliding_window, logit_softcap, kv_scale)
    return out


def triton_attend_paged(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    *,
    kv_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Drop-in for ``attend_paged_reference``: store the new K/V, attend; returns [num_tokens, H, D].
    A decode-only batch (one token per request, no padding rows) in a cache of k's dtype stores them
    inside the decode kernel instead of a launch of its own."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if _fuses_store(k, kv_cache, meta, kv_scale):
        return attend_paged_cached(q, kv_cache, meta, scale, out, sliding_window=sliding_window,
                                   logit_softcap=logit_softcap, new_kv=(k, v))
    triton_store_kv(k, v, kv_cache, meta.slot_mapping, kv_scale=kv_scale)
    return attend_paged_cached(q, kv_cache, meta, scale, out, sliding_window=sliding_window,
                               logit_softcap=logit_softcap, kv_scale=kv_scale)


# The decode kernel stores the new K/V (and rotates q and k) itself while a batch has at most
# ``kernels.max_store_join_pairs`` (decode, kv head) pairs (256; 0: never, to measure); a larger one
# stores and rotates in launches of their own, and its decode kernel runs without them. Joined, the
# kernel saves two launches a layer, which pays where a step is a few short launches (batch 1), but
# it runs slower once its grid fills the card: on an H200, random:llama3-8b (8 kv heads) decode
# attention at 512 decodes took 12.4 ms a step joined and 7.5 ms apart, at 64 decodes 1.63 and
# 1.02 ms, at 8-32 decodes the step was within 1.5% either way, and at batch 1 joined was faster
# (237 against 234 tok/s; random:qwen2.5-0.5b, 2 kv heads, 1,230 against 1,079, and its GPU step
# shorter joined at 1-64 decodes).
def _fuses_store(k, kv_cache, meta: AttentionMetadata, kv_scale) -> bool:
    """Whether the decode kernel stores the new K/V itself: a decode-only batch (one token per
    request, no padding rows) of at most ``kernels.max_store_join_pairs`` (decode, kv head) pairs in
    a cache of k's dtype, without FP8 scales."""
    return (meta.num_decodes == meta.num_reqs == k.shape[0] and kv_cache.dtype == k.dtype and kv_scale is None
            and 0 < k.shape[0] * k.shape[1] <= current().max_store_join_pairs)


def triton_attend_paged_rope(q, k, v, cos, sin_signed, kv_cache, meta: AttentionMetadata, scale: float,
                             sliding_window: int = 0, logit_softcap: float = 0.0, *,
                             kv_scale: Optional[torch.Tensor] = None,
                             cfg: LaunchConfig = LaunchConfig()) -> torch.Tensor:
    """Drop-in for ``attend_paged_rope_reference`` (q and k not yet rotated; cos, sin_signed
    [T or 1, 1, rotary_dim]). Where the decode kernel stores the new K/V itself it also rotates q
    and k as it loads them; any other batch is rotated first (``triton_rotate_qk``: one launch, as
    the model's own rotary was) and goes the way of ``triton_attend_paged``."""
    if _fuses_store(k, kv_cache, meta, kv_scale):
        cos, sin_signed = rotary_rows(cos, q.shape[0]), rotary_rows(sin_signed, q.shape[0])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return attend_paged_cached(q, kv_cache, meta, scale, out, cfg, sliding_window, logit_softcap,
                                   new_kv=(k, v), rope=(cos, sin_signed))
    q, k = triton_rotate_qk(q, k, cos, sin_signed)
    return triton_attend_paged(q, k, v, kv_cache, meta, scale, sliding_window, logit_softcap, kv_scale=kv_scale)


# ``kiln::attend_paged`` on this kernel: cache and metadata come from the forward context.
attend_paged = define_attention_op("kiln_triton::attend_paged", triton_attend_paged)
# ``kiln::attend_paged_rope`` on this kernel (``RopeAttentionFusionPass`` writes it).
attend_paged_rope = define_rope_attention_op("kiln_triton::attend_paged_rope", triton_attend_paged_rope)


# ---------------------------------------------------------------------------------------------
# Correctness check against the reference (tests and `python -m benchmarks.kernels attention --check`)


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]


def check_against_reference(batch: PagedBatch, cfg: LaunchConfig = LaunchConfig(), sliding_window: int = 0,
                            logit_softcap: float = 0.0, *, kv_scale: Optional[torch.Tensor] = None,
                            fused_store: bool = False) -> float:
    """Store + attend with the Triton kernels and the reference on copies of the same cache.
    The cache must match bit for bit; the output, poisoned with NaN first, within ``tolerance``.
    ``fused_store``: the decode kernel stores the new K/V itself (a decode-only batch).
    Returns the largest absolute output error."""
    q, meta = batch.q, batch.meta
    scale = q.shape[2] ** -0.5
    ref_cache = batch.kv_cache.clone()
    ref = attend_paged_reference(q, batch.k, batch.v, ref_cache, meta, scale, sliding_window, logit_softcap,
                                 kv_scale=kv_scale)
    cache = batch.kv_cache.clone()
    out = torch.full_like(q, float("nan"))
    if fused_store:
        attend_paged_cached(q, cache, meta, scale, out, cfg, sliding_window, logit_softcap, new_kv=(batch.k, batch.v))
    else:
        triton_store_kv(batch.k, batch.v, cache, meta.slot_mapping, kv_scale=kv_scale)
    if not torch.equal(cache, ref_cache):
        raise AssertionError("the Triton store wrote a different cache than store_kv_reference")
    if not fused_store:
        attend_paged_cached(q, cache, meta, scale, out, cfg, sliding_window, logit_softcap, kv_scale=kv_scale)
    tol = tolerance(q.dtype)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    return (out.float() - ref.float()).abs().max().item()


def random_rotary(num_tokens: int, rotary_dim: int, dtype: torch.dtype, device, seed: int = 0) -> tuple:
    """[cos, cos] and [-sin, sin] of random angles, [num_tokens, 1, rotary_dim] in ``dtype``: the
    layout ``LlamaForCausalLM`` hands its layers."""
    gen = torch.Generator().manual_seed(seed)
    angles = (torch.rand(num_tokens, 1, rotary_dim // 2, generator=gen) * 100.0).to(device)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def check_rope_against_reference(batch: PagedBatch, cfg: LaunchConfig = LaunchConfig(), sliding_window: int = 0,
                                 logit_softcap: float = 0.0, *, rotary_dim: Optional[int] = None,
                                 kv_scale: Optional[torch.Tensor] = None) -> float:
    """``triton_attend_paged_rope`` (q and k not yet rotated) against ``attend_paged_rope_reference``
    on copies of the same cache, with random rotary tables (``rotary_dim``: head_dim by default).
    The cache must match: bit for bit for fp32 in the interpreter (both round the same fp32
    products), else within ``tolerance`` (a GPU kernel may fuse a multiply-add; the interpreter
    rounds fp32 to 16 bits toward zero); the output within ``tolerance``. Returns the largest
    absolute output error."""
    q, meta = batch.q, batch.meta
    scale = q.shape[2] ** -0.5
    cos, sin_signed = random_rotary(q.shape[0], rotary_dim or q.shape[2], q.dtype, q.device)
    ref_cache = batch.kv_cache.clone()
    ref = attend_paged_rope_reference(q, batch.k, batch.v, cos, sin_signed, ref_cache, meta, scale, sliding_window,
                                      logit_softcap, kv_scale=kv_scale)
    cache = batch.kv_cache.clone()
    out = triton_attend_paged_rope(q, batch.k, batch.v, cos, sin_signed, cache, meta, scale, sliding_window,
                                   logit_softcap, kv_scale=kv_scale, cfg=cfg)
    tol = tolerance(q.dtype)
    if q.device.type == "cpu" and cache.dtype == q.dtype == torch.float32:
        if not torch.equal(cache, ref_cache):
            raise AssertionError("the rotating Triton store wrote a different cache than the reference")
    else:
        torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    return (out.float() - ref.float()).abs().max().item()
