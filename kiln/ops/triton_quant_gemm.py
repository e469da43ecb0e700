"""Triton weight-only GEMMs for decode shapes: fp8 / int8 weights with per-channel scales, int4 with group scales.

At batch 1 a linear layer reads its whole weight to produce one row: the GEMM is a GEMV bound by
the weight's bytes. These kernels read the weight in its stored precision (1 byte or half a byte
a value), dequantize in registers and multiply by activations kept in the model dtype (W8A16,
W4A16: no activation quantization), so a layer costs its quantized bytes and little else::

    kernel             weight                           scales                    y[m, n]
    _channel_kernel    fp8 / int8 [N, K]                [N] (and optional xs [M])  sum_k x[m,k] w[n,k] * s[n] (* xs[m])
                       bf16 / fp16 [N, K] ("dense")     none                      sum_k x[m,k] w[n,k]
    _int4_gemv_kernel  uint8 [N, K/2] read as int32     [K/g, N, 2]: scale, zero   sum_k x[k] ((q[n,k] - 8) s + z), M = 1
    _int4_dot_kernel   words [N, K/8] (8 nibbles each)  [K/g, N, 2]                the same, rows padded to 16, tensor cores
    _int4_kernel       uint8 [N, K/2] (kiln.ops.quant)  [K/g, N, 2]                the same, groups not a multiple of 8

Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``. ``_channel_kernel`` with ``BLOCK_M == 1``
(M = 1) multiplies elementwise into a [BLOCK_N, BLOCK_K] float32 accumulator and reduces it once
at the end; ``num_stages > 1`` pipelines its weight loads (cp.async through shared memory), which
took the H100 from 70-88% to 78-96% of copy bandwidth. With ``BLOCK_M >= 16`` it dequantizes the
tile to the dot dtype and uses ``tl.dot``. ``SPLIT_K > 1`` splits K over programs that add their
partial rows into a zeroed float32 output (``tl.atomic_add``), for layers with too few columns to
fill the GPU.

int4 decodes two nibbles per 32-bit op: in a word shifted right by 4i, ``(v & 0x000F000F) |
0x43004300`` (one LOP3) is the bf16 pair (128 + q[8j+i], 128 + q[8j+4+i]), exact because 128..143
share bf16 128's exponent (the FasterTransformer / Marlin "magic number"). The GEMV turns the pair
into two float32s (a shift, and the word itself, whose low half adds a known offset) and
accumulates ``x (128 + q)`` with FMAs, taking the offsets and the group's scale and zero off once
per group: about 5 ops a weight byte where decoding byte by byte took 14, which had made the
kernel ALU-bound. The dot kernel finishes the pair in bf16x2 (``fma.rn.bf16x2``: minus 136, then
times s plus z, in inline PTX) and feeds the bf16 tile to ``tl.dot`` (wgmma) as its A operand.
Under ``TRITON_INTERPRET=1`` (no PTX) both compute the same values in plain Triton.

Fed GEMVs (``FEED``, ``GemvFeed``; ``_channel_kernel`` at one row, dense or fp8 weights, and
``_int4_gemv_kernel``; one program over all of K): the input row is computed from the op that
feeds the GEMV as it is read (``_fed_x``): the residual add + RMSNorm (the sum of squares beside
the dot, the rsqrt scale at the end, program 0 writing the new residual) or SiLU-and-mul.
``kiln.ops.triton_joined_linear`` calls them; ``FEED = 0`` compiles to the plain GEMVs.

Tile sizes come from ``config_for(scheme, M, N, K)``: a table measured on an H100 for the
llama3-8b shapes and a rule for other shapes. ``triton_linear`` is the entry point;
``kiln.ops.quant_cuda`` decides per call (on the host-side row count, fixed per captured CUDA graph)
whether it or ``torch._scaled_mm`` / a dequantized cuBLAS GEMM runs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kiln.ops.pdl import pdl_args


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _fed_x(x_ptr, res_ptr, gamma_ptr, new_res_ptr, K, cols, ok, write, FEED: tl.constexpr):
    """Columns ``cols`` of a one-row GEMV's input computed from what feeds it (``FEED``), float32,
    and h, the values whose squares an RMSNorm sums (FEED 1; else the input again, unused).
    FEED 1 (add + RMSNorm): h = x + residual rounded to the residual's dtype, as the unfused op rounds
    it (stored to ``new_res_ptr`` where ``write``), times the norm's weight; the GEMV scales its
    sums by rsqrt(mean(h^2) + eps) at the end. FEED 2 (SiLU-and-mul): silu(x[c]) * x[K + c], rounded
    to x's dtype where ``silu_and_mul`` rounds (after silu, after the product)."""
    if FEED == 1:
        x = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        h = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + cols, h, mask=ok & write)
        hf = h.to(tl.float32)
        return hf * tl.load(gamma_ptr + cols, mask=ok, other=0.0).to(tl.float32), hf
    else:
        gate = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=ok, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        a = (silu * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        return a, a


@triton.jit
def _channel_kernel(x_ptr, w_ptr, s_ptr, xs_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_wn, stride_ym,
                    res_ptr, gamma_ptr, new_res_ptr, bias_ptr, eps,
                    X_SCALED: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr = 1,
                    USE_PDL: tl.constexpr = False, W_SCALED: tl.constexpr = True, FEED: tl.constexpr = 0,
                    HAS_BIAS: tl.constexpr = False):
    if USE_PDL:  # kiln.ops.pdl: blocks launch during the kernel before and wait for it here
        tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_k * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if BLOCK_M == 1:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)  # FEED 1: the norm's sum of squares
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):  # weight loads pipelined (cp.async)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if FEED != 0:  # one row, no split: the input computed from the op that feeds the GEMV
                k_ok = offs_k < k_hi
                x, h = _fed_x(x_ptr, res_ptr, gamma_ptr, new_res_ptr, K, offs_k, k_ok, pid_n == 0, FEED)
                if FEED == 1:
                    sq += h * h
                if EVEN_K:
                    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
                else:
                    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            elif EVEN_K:
                x = tl.load(x_ptr + pid_m * stride_xm + offs_k).to(tl.float32)
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                k_ok = offs_k < k_hi
                x = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc2 += w.to(tl.float32) * x[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]
        if FEED == 1:
            acc = acc * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None], other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                k_ok = offs_k < k_hi
                x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_F32:
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    if W_SCALED:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if X_SCALED:
        acc = acc * tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :], sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _nibbles(b, s, z, BLOCK_N: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr):
    """uint8 [BLOCK_N, PAIRS] -> the dequantized even and odd columns, float32 [BLOCK_N, PAIRS] each."""
    bi = b.to(tl.int32)
    lo = ((bi & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q - 8, exactly
    hi = ((bi >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    lo = tl.reshape(lo, (BLOCK_N, NG, GROUP // 2)) * s[:, :, None] + z[:, :, None]
    hi = tl.reshape(hi, (BLOCK_N, NG, GROUP // 2)) * s[:, :, None] + z[:, :, None]
    return tl.reshape(lo, (BLOCK_N, NG * (GROUP // 2))), tl.reshape(hi, (BLOCK_N, NG * (GROUP // 2)))


@triton.jit
def _int4_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_wn, stride_ym,
                 GROUP: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PAIRS: tl.constexpr = BLOCK_K // 2
    NG: tl.constexpr = BLOCK_K // GROUP
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_k * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    sz_cols = sz_ptr + offs_n[:, None] * 2
    if BLOCK_M == 1:
        acc_g = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_p = k0 // 2 + tl.arange(0, PAIRS)  # byte columns
        offs_g = k0 // GROUP + tl.arange(0, NG)
        if EVEN_K:
            b = tl.load(w_rows + offs_p[None, :], mask=n_ok[:, None], other=0)
            sz_ok = n_ok[:, None]
        else:
            b = tl.load(w_rows + offs_p[None, :], mask=n_ok[:, None] & (2 * offs_p < k_hi)[None, :], other=0)
            sz_ok = n_ok[:, None] & (offs_g * GROUP < k_hi)[None, :]
        sz = sz_cols + offs_g[None, :] * (2 * N)
        s = tl.load(sz, mask=sz_ok, other=0.0).to(tl.float32)
        z = tl.load(sz + 1, mask=sz_ok, other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            # sum_k x (q - 8) per group first, then one scale and one zero per group:
            # sum_k x ((q - 8) s + z) = s sum_k x (q - 8) + z sum_k x.
            if EVEN_K:
                xe = tl.load(x_ptr + pid_m * stride_xm + 2 * offs_p).to(tl.float32)
                xo = tl.load(x_ptr + pid_m * stride_xm + 2 * offs_p + 1).to(tl.float32)
            else:
                p_ok = 2 * offs_p < k_hi
                xe = tl.load(x_ptr + pid_m * stride_xm + 2 * offs_p, mask=p_ok, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + pid_m * stride_xm + 2 * offs_p + 1, mask=p_ok, other=0.0).to(tl.float32)
            bi = b.to(tl.int32)
            lo = ((bi & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q - 8, exactly
            hi = ((bi >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            t = tl.sum(tl.reshape(lo * xe[None, :] + hi * xo[None, :], (BLOCK_N, NG, GROUP // 2)), axis=2)
            xsum = tl.sum(tl.reshape(xe + xo, (NG, GROUP // 2)), axis=1)
            acc_g += t * s + z * xsum[None, :]
        else:
            lo, hi = _nibbles(b, s, z, BLOCK_N, NG, GROUP)
            x_rows = x_ptr + offs_m[:, None] * stride_xm + 2 * offs_p[None, :]
            if EVEN_K:
                xe = tl.load(x_rows, mask=m_ok[:, None], other=0.0)
                xo = tl.load(x_rows + 1, mask=m_ok[:, None], other=0.0)
            else:
                x_ok = m_ok[:, None] & (2 * offs_p < k_hi)[None, :]
                xe = tl.load(x_rows, mask=x_ok, other=0.0)
                xo = tl.load(x_rows + 1, mask=x_ok, other=0.0)
            if DOT_F32:
                acc = tl.dot(xe.to(tl.float32), tl.trans(lo), acc, input_precision="ieee")
                acc = tl.dot(xo.to(tl.float32), tl.trans(hi), acc, input_precision="ieee")
            else:
                acc = tl.dot(xe.to(tl.bfloat16), tl.trans(lo.to(tl.bfloat16)), acc)
                acc = tl.dot(xo.to(tl.bfloat16), tl.trans(hi.to(tl.bfloat16)), acc)
    if BLOCK_M == 1:
        acc = tl.sum(acc_g, axis=1)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :], sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Two weights of an int4 word per 32-bit op (the "magic number" trick of FasterTransformer / Marlin):
# ``(v & 0x000F000F) | 0x43004300`` is the bf16 pair (128 + q_lo, 128 + q_hi), exact since 128..143
# share bf16 128's exponent; one packed FMA takes off 136 ((q - 8) exactly), one more applies the
# group's scale and zero. Per pair of elements a, b: in v_a, v_b (int32, the word shifted so the two
# nibbles sit at bits 0 and 16), s, z (bf16 pairs); out lo = nibbles at bit 0, hi = nibbles at bit 16.
@triton.jit
def _int4_words(wd, s, z, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr,
                USE_ASM: tl.constexpr):
    """int32 words [BLOCK_N, WORDS] (8 nibbles each, nibble i = column 8j + i) and their groups'
    scales and zeros [BLOCK_N, NG] -> the dequantized columns 8j + i (lo) and 8j + 4 + i (hi), i < 4,
    each [BLOCK_N, 4 WORDS] in column order (j, i)."""
    v = tl.reshape(wd[:, :, None] >> (4 * tl.arange(0, 4))[None, None, :], (BLOCK_N, 4 * WORDS))
    s2 = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, NG, GROUP // 2)), (BLOCK_N, 4 * WORDS))
    z2 = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, NG, GROUP // 2)), (BLOCK_N, 4 * WORDS))
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            """{
            .reg .b32 ta, tb, l, h, one, bias;
            mov.b32 one, 0x3F803F80;
            mov.b32 bias, 0xC308C308;
            lop3.b32 ta, $2, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 tb, $3, 0x000F000F, 0x43004300, 0xEA;
            prmt.b32 l, ta, tb, 0x5410;
            prmt.b32 h, ta, tb, 0x7632;
            fma.rn.bf16x2 l, l, one, bias;
            fma.rn.bf16x2 h, h, one, bias;
            fma.rn.bf16x2 $0, l, $4, $5;
            fma.rn.bf16x2 $1, h, $4, $5;
            }""", "=r,=r,r,r,r,r", [v, s2, z2],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    else:  # the interpreter (no PTX) and non-bf16 scales: the same values in float32
        s2 = s2.to(tl.float32)
        z2 = z2.to(tl.float32)
        lo = ((v & 0xF) - 8).to(tl.float32) * s2 + z2
        hi = (((v >> 16) & 0xF) - 8).to(tl.float32) * s2 + z2
    return lo, hi


@triton.jit
def _int4_dot_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, k_split, stride_xm, stride_wn, stride_ym,
                     GROUP: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                     USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int4 on the tensor cores: y^T [BLOCK_N, BLOCK_M] += W tile (dequantized to bf16 in registers,
    the dot's A operand) @ x^T, rows of x padded to BLOCK_M = 16 by masking. ``w_ptr`` is the
    [N, K/2] uint8 weight read as int32 words [N, K/8] (``stride_wn`` in words)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // GROUP
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_k * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    sz_cols = sz_ptr + offs_n[:, None] * 2
    # Column c of a dequantized half is word c // 4, nibble c % 4 (lo) or c % 4 + 4 (hi).
    cols = tl.arange(0, 4 * WORDS)
    k_of_col = 8 * (cols // 4) + cols % 4
    x_cols = x_ptr + offs_m[None, :] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_w = k0 // 8 + tl.arange(0, WORDS)
        offs_g = k0 // GROUP + tl.arange(0, NG)
        k_lo_cols = k0 + k_of_col
        if EVEN_K:
            wd = tl.load(w_rows + offs_w[None, :], mask=n_ok[:, None], other=0)
            sz_ok = n_ok[:, None]
            x_ok = m_ok[None, :]
        else:
            wd = tl.load(w_rows + offs_w[None, :], mask=n_ok[:, None] & (8 * offs_w < k_hi)[None, :], other=0)
            sz_ok = n_ok[:, None] & (offs_g * GROUP < k_hi)[None, :]
            x_ok = m_ok[None, :] & (k_lo_cols < k_hi)[:, None]
        sz = sz_cols + offs_g[None, :] * (2 * N)
        s = tl.load(sz, mask=sz_ok, other=0.0)
        z = tl.load(sz + 1, mask=sz_ok, other=0.0)
        lo, hi = _int4_words(wd, s, z, BLOCK_N, WORDS, NG, GROUP, USE_ASM)
        x_lo = tl.load(x_cols + k_lo_cols[:, None], mask=x_ok, other=0.0)  # [4 WORDS, BLOCK_M]
        x_hi = tl.load(x_cols + k_lo_cols[:, None] + 4, mask=x_ok, other=0.0)
        if DOT_F32:
            acc = tl.dot(lo.to(tl.float32), x_lo.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(hi.to(tl.float32), x_hi.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(lo.to(tl.bfloat16), x_lo.to(tl.bfloat16), acc)
            acc = tl.dot(hi.to(tl.bfloat16), x_hi.to(tl.bfloat16), acc)
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=n_ok[:, None] & m_ok[None, :], sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _nibble_pairs(v, USE_ASM: tl.constexpr):
    """``(v & 0x000F000F) | 0x43004300`` in one LOP3 (ptxas leaves Triton's and + or as two)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [v],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (v & 0x000F000F) | 0x43004300


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, N, K, k_split, stride_wn, res_ptr, gamma_ptr, new_res_ptr, eps,
                      GROUP: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
                      EXACT: tl.constexpr, STAGES: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
                      FEED: tl.constexpr = 0):
    """One row: y[n] = sum_k x[k] ((q[n,k] - 8) s + z), the weight read as int32 words [N, K/8].

    Two nibbles per 32-bit op: ``(v & 0x000F000F) | 0x43004300`` holds the bf16 pair (128 + q_i,
    128 + q_(i+4)) of word v shifted by 4i (exact: 128..143 share bf16 128's exponent); the low half
    shifted up is the float32 128 + q_i, the word itself is the float32 128 + q_(i+4) plus a known
    offset, and both multiply into float32 sums t = sum x (128 + q). Per group, the offsets come off
    once: sum x ((q - 8) s + z) = (t - offsets) s + z sum x. About 5 integer/float ops per weight byte
    where the byte-wise path takes 14, so the GEMV is bound by memory, not by the ALU.

    With ``USE_PDL`` (``kiln.ops.pdl``) its blocks launch while the kernel before still runs and
    wait for it here; the next kernel's blocks may launch once this one's loads are all issued.
    ``FEED`` 1 / 2 (one program over all of K): x is computed from what feeds the GEMV (``_fed_x``)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    WORDS: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // GROUP
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_lo = pid_k * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    sz_cols = sz_ptr + offs_n[:, None] * 2
    offs_j = tl.arange(0, WORDS)
    acc_g = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    sq = tl.zeros((WORDS,), dtype=tl.float32)  # FEED 1: the norm's sum of squares
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):  # weight loads pipelined (cp.async)
        offs_g = k0 // GROUP + tl.arange(0, NG)
        if EVEN_K:
            wd = tl.load(w_rows + (k0 // 8 + offs_j)[None, :], mask=n_ok[:, None], other=0)
            sz_ok = n_ok[:, None]
            x_ok = offs_j >= 0
        else:
            x_ok = k0 + 8 * offs_j < k_hi
            wd = tl.load(w_rows + (k0 // 8 + offs_j)[None, :], mask=n_ok[:, None] & x_ok[None, :], other=0)
            sz_ok = n_ok[:, None] & (offs_g * GROUP < k_hi)[None, :]
        x_words = x_ptr + k0 + 8 * offs_j
        t = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        x_lo_sum = tl.zeros((WORDS,), dtype=tl.float32)
        x_hi_sum = tl.zeros((WORDS,), dtype=tl.float32)
        for i in tl.static_range(4):
            if FEED == 0:
                x_lo = tl.load(x_words + i, mask=x_ok, other=0.0).to(tl.float32)  # column 8j + i
                x_hi = tl.load(x_words + i + 4, mask=x_ok, other=0.0).to(tl.float32)  # column 8j + 4 + i
            else:
                cols = k0 + 8 * offs_j + i
                x_lo, h_lo = _fed_x(x_ptr, res_ptr, gamma_ptr, new_res_ptr, K, cols, x_ok, pid_n == 0, FEED)
                x_hi, h_hi = _fed_x(x_ptr, res_ptr, gamma_ptr, new_res_ptr, K, cols + 4, x_ok, pid_n == 0, FEED)
                if FEED == 1:
                    sq += h_lo * h_lo + h_hi * h_hi
            pair = _nibble_pairs(wd >> (4 * i), USE_ASM)
            lo = (pair << 16).to(tl.float32, bitcast=True)  # 128 + q[8j + i], exactly
            if EXACT:
                hi = (pair & -65536).to(tl.float32, bitcast=True)  # 128 + q[8j + 4 + i]
            else:  # the word as a float32: 128 + q[8j + 4 + i] + (0x4300 + q[8j + i]) / 2^16
                hi = pair.to(tl.float32, bitcast=True)
            t = t + lo * x_lo[None, :]  # two FMAs, no separate multiply
            t = t + hi * x_hi[None, :]
            x_lo_sum += x_lo
            x_hi_sum += x_hi
        t_g = tl.sum(tl.reshape(t, (BLOCK_N, NG, GROUP // 8)), axis=2)
        x_lo_g = tl.sum(tl.reshape(x_lo_sum, (NG, GROUP // 8)), axis=1)
        x_hi_g = tl.sum(tl.reshape(x_hi_sum, (NG, GROUP // 8)), axis=1)
        # sum x (q - 8) = t - 136 sum x_lo - (136 + 0x4300 / 2^16) sum x_hi, up to q[8j + i] / 2^16 per
        # weight (under 2.3e-4 of a quantization step, far below bf16 activations' rounding).
        offset = 136.0 * x_lo_g + (136.0 if EXACT else 136.26171875) * x_hi_g
        x_g = x_lo_g + x_hi_g
        sz = sz_cols + offs_g[None, :] * (2 * N)
        s = tl.load(sz, mask=sz_ok, other=0.0).to(tl.float32)
        z = tl.load(sz + 1, mask=sz_ok, other=0.0).to(tl.float32)
        acc_g += (t_g - offset[None, :]) * s + z * x_g[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.sum(acc_g, axis=1)
    if FEED == 1:
        acc = acc * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    if ATOMIC:
        tl.atomic_add(y_ptr + offs_n, acc, mask=n_ok, sem="relaxed")
    else:
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _int4_dequant_kernel(w_ptr, sz_ptr, out_ptr, N, K, stride_wn, stride_on,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The full [N, K] weight in out's dtype, for the rows counts where a dense GEMM wins."""
    PAIRS: tl.constexpr = BLOCK_K // 2
    NG: tl.constexpr = BLOCK_K // GROUP
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_p = k0 // 2 + tl.arange(0, PAIRS)
    offs_g = k0 // GROUP + tl.arange(0, NG)
    ok = (offs_n < N)[:, None] & (2 * offs_p < K)[None, :]
    b = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_p[None, :], mask=ok, other=0)
    g_ok = (offs_n < N)[:, None] & (offs_g * GROUP < K)[None, :]
    sz = sz_ptr + offs_g[None, :] * (2 * N) + offs_n[:, None] * 2
    s = tl.load(sz, mask=g_ok, other=0.0).to(tl.float32)
    z = tl.load(sz + 1, mask=g_ok, other=0.0).to(tl.float32)
    lo, hi = _nibbles(b, s, z, BLOCK_N, NG, GROUP)
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # columns 2p, 2p + 1
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])


def triton_dequant_int4(w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """``kiln.ops.quant.dequant_int4_reference`` in one launch."""
    n, k = scales_zeros.shape[1], scales_zeros.shape[0] * group_size
    out = torch.empty((n, k), dtype=dtype, device=w.device)
    block_k = max(128, group_size)
    grid = (triton.cdiv(n, 32), triton.cdiv(k, block_k))
    _int4_dequant_kernel[grid](w, scales_zeros, out, n, k, w.stride(0), out.stride(0), GROUP=group_size,
                               BLOCK_N=32, BLOCK_K=block_k, num_warps=4)
    return out


# ---- configurations ------------------------------------------------------------------------------

# (scheme, M bucket, N, K) -> config: the fastest of a sweep on an H100 (python -m benchmarks.kernels quant-gemm
# --sweep; results in benchmarks/results/kernels-{H100,H200}.md, runs quant_gemm*) for the llama3-8b linears (qkv 6144x4096,
# o 4096x4096, gate_up 28672x4096, down 4096x14336); int8 reads the fp8 rows.
_QKV, _O, _GATE_UP, _DOWN = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
_LM_HEAD = (128256, 4096)
MEASURED: dict[tuple[str, int, int, int], GemmConfig] = {
    # bf16 weights at one row (H100, us against cuBLAS's): qkv 18.8 (20.8), o 13.3 (16.7),
    # gate_up 76.9 (82.0), down 40.6 (44.8), LM head 332 (373); the rule's tile is within 3%
    ("dense", 1, *_QKV): GemmConfig(1, 4, 512, 1, num_warps=2, num_stages=3),
    ("dense", 1, *_O): GemmConfig(1, 4, 512, 1, num_warps=2, num_stages=4),
    ("dense", 1, *_GATE_UP): GemmConfig(1, 8, 1024, 1, num_warps=8, num_stages=3),
    ("dense", 1, *_DOWN): GemmConfig(1, 4, 512, 1, num_warps=2, num_stages=3),
    ("dense", 1, *_LM_HEAD): GemmConfig(1, 8, 1024, 1, num_warps=8, num_stages=4),
    # one row: num_stages > 1 pipelines the weight loads (cp.async through shared memory)
    ("fp8", 1, *_QKV): GemmConfig(1, 8, 512, 1, num_warps=2, num_stages=3),
    ("fp8", 1, *_O): GemmConfig(1, 8, 512, 1, num_warps=2, num_stages=4),
    ("fp8", 1, *_GATE_UP): GemmConfig(1, 8, 1024, 1, num_stages=3),
    ("fp8", 1, *_DOWN): GemmConfig(1, 8, 1024, 1, num_stages=3),
    ("fp8", 16, *_QKV): GemmConfig(16, 32, 256, 1),
    ("fp8", 16, *_O): GemmConfig(16, 32, 256, 1),
    ("fp8", 16, *_GATE_UP): GemmConfig(16, 32, 128, 1),
    ("fp8", 16, *_DOWN): GemmConfig(16, 32, 256, 4),
    ("fp8", 32, *_QKV): GemmConfig(32, 64, 128, 4),
    ("fp8", 32, *_O): GemmConfig(32, 64, 128, 8),
    ("fp8", 32, *_GATE_UP): GemmConfig(32, 64, 128, 1),
    ("fp8", 32, *_DOWN): GemmConfig(32, 64, 128, 8),
    # the word-wise GEMV at one row (its loads unpipelined), the tensor-core tile at 2-16
    # 8-row tiles, no split-K (python -m benchmarks.kernels int4-split, with PDL; H100, us before -> after):
    # qkv 9.99 -> 8.47, o 7.15 -> 6.99, gate_up 32.0 -> 29.6, down 20.9 -> 18.4 (its split-K took a
    # zero fill and a cast a call besides the GEMV)
    ("int4", 1, *_QKV): GemmConfig(1, 8, 2048, 1, num_warps=4, num_stages=1),
    ("int4", 1, *_O): GemmConfig(1, 8, 2048, 1, num_warps=4, num_stages=1),
    ("int4", 1, *_GATE_UP): GemmConfig(1, 8, 1024, 1, num_warps=2, num_stages=1),
    ("int4", 1, *_DOWN): GemmConfig(1, 8, 2048, 1, num_warps=4, num_stages=1),
    ("int4", 16, *_QKV): GemmConfig(16, 64, 256, 4),
    ("int4", 16, *_O): GemmConfig(16, 64, 256, 4),
    ("int4", 16, *_GATE_UP): GemmConfig(16, 64, 256, 2),
    ("int4", 16, *_DOWN): GemmConfig(16, 64, 256, 4),
}

M_BUCKETS = (1, 16, 32, 64)


def load_measured(best: dict) -> None:
    """Entries ``"scheme,M,N,K": [block_m, block_n, block_k, split_k, num_warps, num_stages]`` (as
    python -m benchmarks.kernels quant-gemm writes them) over every card's table (``LOADED``)."""
    for key, cfg in best.items():
        scheme, m, n, k = key.split(",")
        LOADED[(scheme, m_bucket(int(m)), int(n), int(k))] = GemmConfig(*cfg)
    _device_table.cache_clear()
    _measured_n.cache_clear()


TARGET_PROGRAMS = 264  # two per SM of an H100


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return 128


def default_config(scheme: str, m: int, n: int, k: int, group_size: int = 32) -> GemmConfig:
    """A rule for shapes not in the table, after the measured ones: a narrow GEMV tile at M = 1, a
    16- or 32-row dot tile up to 32, and split-K until about two programs per SM run."""
    bm = m_bucket(m)
    if bm == 1:
        bn, bk = (16, 1024 if k >= 4096 else 256) if scheme == "int4" else (8, 1024 if k >= 4096 else 512)
    elif bm <= 32:
        bn, bk = (128 if scheme == "int4" else 32 if bm == 16 else 64), 128
    else:
        bm, bn, bk = min(bm, 64), 128, 64
    if scheme == "int4":
        bk = max(bk, group_size)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    split = 1
    # Split-K costs a zeroed float32 output and a cast: only for layers too narrow to fill the GPU.
    while tiles * split < TARGET_PROGRAMS // (4 if bm == 1 else 1) and k // (2 * split) >= 4 * bk:
        split *= 2
    # One row: fp8 pipelines its weight loads, the int4 GEMV measured faster without.
    stages = 1 if bm == 1 and scheme == "int4" else 3
    return GemmConfig(bm, bn, bk, split, num_warps=4 if bm <= 32 else 8, num_stages=stages)


# Entries measured on another card, over MEASURED's, by a substring of the device name.
MEASURED_ON: dict[str, dict[tuple[str, int, int, int], GemmConfig]] = {
    # bf16 at one row on an H200 (us against H100's tile): qkv 13.67 (14.08), o 9.99 (10.31),
    # gate_up 55.02 (56.01), down 28.88 (29.59); cuBLAS 15.95, 13.43, 63.15, 32.47
    "H200": {
        ("dense", 1, *_QKV): GemmConfig(1, 8, 256, 1, num_warps=2, num_stages=4),
        ("dense", 1, *_O): GemmConfig(1, 16, 256, 1, num_warps=4, num_stages=4),
        ("dense", 1, *_GATE_UP): GemmConfig(1, 8, 256, 1, num_warps=2, num_stages=3),
        ("dense", 1, *_DOWN): GemmConfig(1, 8, 512, 1, num_warps=4, num_stages=4),
        # gate_up fed by add + RMSNorm (python -m benchmarks.kernels gemv-join --sweep): 55.74 us against 60.17 with
        # the plain GEMV's 8-row tile (56.06 for the norm kernel and the GEMV apart)
        ("dense+norm", 1, *_GATE_UP): GemmConfig(1, 32, 256, 1, num_warps=4, num_stages=4),
    },
}


LOADED: dict[tuple[str, int, int, int], GemmConfig] = {}  # load_measured's, over both


@functools.lru_cache(maxsize=None)
def _device_table(device_name: str) -> dict:
    return {**MEASURED, **next((t for key, t in MEASURED_ON.items() if key in device_name), {}), **LOADED}


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


def _measured() -> dict:
    return _device_table(_device())


def config_for(scheme: str, m: int, n: int, k: int, group_size: int = 32, feed: str = "") -> GemmConfig:
    """The measured configuration for this card (int8 takes fp8's: the same kernel, the same
    bytes), else the rule. A fed GEMV (``feed``: "norm", "silu") takes an entry of its own,
    ``("<scheme>+<feed>", 1, N, K)``, where one was measured, else the plain GEMV's."""
    bucket = m_bucket(m)
    table = _measured()
    n = _measured_n(_device(), bucket, n, k)
    fed = table.get((f"{scheme}+{feed}", bucket, n, k)) if feed else None
    if fed is not None and (scheme != "int4" or fed.block_k % group_size == 0):
        return fed
    found = table.get((scheme, bucket, n, k)) or table.get(("fp8" if scheme == "int8" else "", bucket, n, k))
    if found is not None and (scheme != "int4" or found.block_k % group_size == 0):
        return found
    return default_config(scheme, m, n, k, group_size)


NEAR_N = 1.07  # a GEMM up to this much wider than a measured one takes its entries


@functools.lru_cache(maxsize=None)
def _measured_n(device_name: str, bucket: int, n: int, k: int) -> int:
    """``n``, or the widest measured N of this (M bucket, K) a few percent under it: a LoRA-joined
    GEMM (``kiln.models.lora``: every slot's A rows after W's, 2-6% more rows on llama3-8b)
    computes the same shape plus a sliver, and its measured tile measured faster than the rule's."""
    table = _device_table(device_name)
    if any(key[1:] == (bucket, n, k) for key in table):
        return n
    near = [key[2] for key in table if key[1] == bucket and key[3] == k and key[2] <= n <= key[2] * NEAR_N]
    return max(near, default=n)


# ---- launch ------------------------------------------------------------------------------------

def _launch_args(x2: torch.Tensor, n: int, k: int, cfg: GemmConfig, out_dtype: torch.dtype):
    m = x2.shape[0]
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_split)
    if split > 1:
        y = torch.zeros((m, n), dtype=torch.float32, device=x2.device)
    else:
        y = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    # Triton's interpreter multiplies bfloat16 tiles wrongly in tl.dot: there the dot runs in float32.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    flags = dict(ATOMIC=split > 1, EVEN_K=k % cfg.block_k == 0,
                 DOT_F32=interpreted or x2.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn),
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y, k_split, grid, flags


def _int4_words_fit(w: torch.Tensor, k: int, group_size: int) -> bool:
    """Whether the tensor-core kernel takes this weight: whole words per group and per row."""
    return group_size % 8 == 0 and k % 8 == 0 and w.stride(-1) == 1 and w.stride(0) % 4 == 0 and (
        w.storage_offset() % 4 == 0)


@dataclass(frozen=True)
class GemvFeed:
    """What a one-row GEMV computes its input row from, as it reads it (``_fed_x``): ``kind`` "norm",
    the add + RMSNorm ``weight * rms_norm(x + residual)`` (writing ``x + residual`` into
    ``new_residual``), or "silu", ``silu(x[:K]) * x[K:]`` of the gate/up row x [1, 2K]."""

    kind: str
    residual: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    eps: float = 0.0
    new_residual: Optional[torch.Tensor] = None

    @property
    def code(self) -> int:
        return {"norm": 1, "silu": 2}[self.kind]


def feed_fits(scheme: str, cfg: GemmConfig, n: int, k: int, group_size: int, w: torch.Tensor) -> bool:
    """Whether ``cfg`` is a tile a fed GEMV can run: one row in one program over all of K (no
    split-K); dense and fp8 weights (``_channel_kernel``), and int4 in the word-wise GEMV."""
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    if cfg.block_m != 1 or triton.cdiv(k, k_split) != 1:
        return False
    return scheme in ("dense", "fp8") or (scheme == "int4" and cfg.block_k % group_size == 0
                                          and _int4_words_fit(w, k, group_size))


def triton_linear(scheme: str, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int,
                  x_scales: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                  config: Optional[GemmConfig] = None, feed: Optional[GemvFeed] = None,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ dequant(w).T`` for canonical weights (``kiln.ops.quant``) of ``scheme``; ``x_scales`` [M, 1]
    multiplies row m (x given as fp8 rows), ``out_dtype`` defaults to x's dtype. Scheme ``dense``:
    a weight in the model dtype, no scales (``scales`` is ignored). ``feed``: the GEMV's one input
    row is computed from x (``GemvFeed``; dense, fp8 and int4, tiles that ``feed_fits``). ``bias``
    (dense at one row, one program over K) is added in the kernel."""
    k = x.shape[-1] // 2 if feed is not None and feed.kind == "silu" else x.shape[-1]
    n = scales.shape[1] if scheme == "int4" else w.shape[0]
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)
    cfg = config or config_for(scheme, m, n, k, group_size, feed.kind if feed is not None else "")
    if m > 1 and cfg.block_m == 1:
        raise ValueError("a BLOCK_M = 1 config takes one row")
    if (feed is not None or bias is not None) and (m != 1 or not feed_fits(scheme, cfg, n, k, group_size, w)):
        raise ValueError(f"a fed GEMV or an in-kernel bias takes one row and a one-program tile, not {cfg}")
    if bias is not None and scheme != "dense":
        raise ValueError("an in-kernel bias is the dense GEMV's")
    y, k_split, grid, flags = _launch_args(x2, n, k, cfg, out_dtype)
    fed = dict(res_ptr=x2, gamma_ptr=x2, new_res_ptr=x2, eps=0.0, FEED=0)  # unread without a feed
    if feed is not None:
        fed = dict(res_ptr=feed.residual if feed.residual is not None else x2,
                   gamma_ptr=feed.weight if feed.weight is not None else x2,
                   new_res_ptr=feed.new_residual if feed.new_residual is not None else x2,
                   eps=feed.eps, FEED=feed.code)
    if scheme == "int4":
        if cfg.block_k % group_size or group_size % 2:
            raise ValueError(f"int4 BLOCK_K {cfg.block_k} must be a multiple of the group size {group_size}")
        if cfg.block_m == 1 and _int4_words_fit(w, k, group_size):
            _int4_gemv_kernel[grid](x2, w.view(torch.int32), scales, y, n, k, k_split, w.stride(0) // 4, **fed,
                                    GROUP=group_size, ATOMIC=flags["ATOMIC"], EVEN_K=flags["EVEN_K"],
                                    USE_ASM=os.environ.get("TRITON_INTERPRET") != "1",
                                    EXACT=x2.dtype not in (torch.bfloat16, torch.float16), STAGES=cfg.num_stages,
                                    BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                                    num_stages=cfg.num_stages, **pdl_args(x2, "gemm"))
        elif cfg.block_m >= 16 and _int4_words_fit(w, k, group_size):
            # the uint8 [N, K/2] weight read as int32 words [N, K/8]
            use_asm = not flags["DOT_F32"] and x2.dtype == torch.bfloat16 and scales.dtype == torch.bfloat16
            _int4_dot_kernel[grid](x2, w.view(torch.int32), scales, y, m, n, k, k_split, x2.stride(0),
                                   w.stride(0) // 4, y.stride(0), GROUP=group_size, USE_ASM=use_asm, **flags)
        else:
            _int4_kernel[grid](x2, w, scales, y, m, n, k, k_split, x2.stride(0), w.stride(0), y.stride(0),
                               GROUP=group_size, **flags)
    else:
        scales = w if scales is None else scales  # dense: unused
        xs = x_scales if x_scales is not None else scales  # unused when not X_SCALED
        _channel_kernel[grid](x2, w, scales, xs, y, m, n, k, k_split, x2.stride(0), w.stride(0), y.stride(0),
                              bias_ptr=bias if bias is not None else x2, HAS_BIAS=bias is not None, **fed,
                              X_SCALED=x_scales is not None, STAGES=cfg.num_stages, W_SCALED=scheme != "dense",
                              **flags, **(pdl_args(x2, "gemm") if cfg.block_m == 1 else {}))
    return y.to(out_dtype).reshape(*x.shape[:-1], n)
