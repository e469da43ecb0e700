"""Triton kernels that produce FP8 activations: add + RMSNorm + quant, SiLU-and-mul + quant.

Each program owns one row (token): it computes the row exactly as ``kiln_triton::add_rms_norm`` /
``kiln_triton::silu_and_mul`` do (same roundings to the model dtype), takes the row's absolute
maximum, and writes the row as float8_e4m3fn with one float32 scale ``amax / 448``, so the GEMM
that follows (``kiln_triton::linear_fp8_prequant``: ``torch._scaled_mm``, or at decode rows the
Triton weight-only kernel reading the fp8 rows and their scales) reads one byte per value and no
separate quantization pass over the activations runs::

    add_rms_norm_quant_fp8  grid (num_tokens,)  the whole row in registers (hidden <= 16384)
    silu_and_mul_quant_fp8  grid (num_tokens,)  the whole row in registers (d <= 16384), else two sweeps
                                                over d in blocks (up to 4096): amax, then write
    quantize_fp8_per_token  grid (num_tokens,)  the same two sweeps, for an FP8 GEMM's unfused input

The ops ``kiln_triton::add_rms_norm_quant_fp8`` and ``kiln_triton::silu_and_mul_quant_fp8`` have the
schemas of the references in ``kiln.ops.quant``; ``check_against_reference`` compares them.

``GemmInputFusionPass`` writes the joined ops ``kiln_triton::add_rms_norm_linear_fp8`` and
``kiln_triton::silu_and_mul_linear_fp8`` (norm / activation and the GEMM it feeds). They pick by
the row count of the call: above ``FP8_TRITON_MAX_ROWS``, the kernels above and the GEMM on fp8
rows; at decode rows, where the GEMM is the weight-only (W8A16) kernel that needs no quantized
activations, the plain ``add_rms_norm`` / ``silu_and_mul`` kernels (``kiln.ops.triton_norm``: the
activation one spreads a row over many programs, where the quantizing one sweeps it in one) and the
GEMM on the model-dtype rows. On CUDA the KernelSet joins with ``kiln_cuda``'s ops
(``kiln.ops.triton_joined_linear``) instead, which at one row run one fed GEMV and elsewhere these;
these serve as they are with ``kernels.gemv_join=[]``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.ops.quant import (FP8_DTYPE, FP8_MAX, add_rms_norm_linear_fp8_reference, add_rms_norm_quant_fp8_reference,
                            define_fp8_fused_linear_ops, define_fp8_fusion_ops, fp8_weight_only_rows,
                            linear_fp8_prequant_reference, quantize_fp8_per_token, silu_and_mul_linear_fp8_reference,
                            silu_and_mul_quant_fp8_reference)
from kiln.ops.triton_norm import triton_add_rms_norm, triton_silu_and_mul
from kiln.ops.triton_quant_gemm import triton_linear

_SILU_BLOCK = 1024


def _row_sweep_launch(n_cols: int) -> dict:
    """BLOCK and warps for the kernels that sweep a row twice in one program: wide blocks, so a
    decode row (one program for the whole GPU) takes few serial, latency-bound steps (4 per sweep
    at d = 14336, not 14)."""
    block = min(4096, max(_SILU_BLOCK, triton.next_power_of_2(n_cols)))
    return {"BLOCK": block, "num_warps": max(4, block // 256)}


@triton.jit
def _add_rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, new_res_ptr, n_cols, eps,
                               stride_x, stride_r, stride_q, stride_nr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    res = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
    r = (x.to(tl.float32) + res.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * stride_nr + cols, r, mask=ok)
    rf = r.to(tl.float32)
    inv = tl.rsqrt(tl.sum(rf * rf, axis=0) / n_cols + eps)
    y = (rf * inv).to(new_res_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (w * y).to(new_res_ptr.dtype.element_ty).to(tl.float32)  # the unfused op's output
    scale = tl.maximum(tl.max(tl.abs(normed), axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    q = tl.minimum(tl.maximum(normed / scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_row(x_ptr, row, stride_x, d, cols, ok, OUT_DTYPE: tl.constexpr):
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)
    return (silu * up).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, d, stride_x, stride_q, FP8_MAX: tl.constexpr,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < d
        y = _silu_row(x_ptr, row, stride_x, d, cols, ok, x_ptr.dtype.element_ty)
        amax = tl.maximum(amax, tl.where(ok, tl.abs(y), 0.0))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < d
        y = _silu_row(x_ptr, row, stride_x, d, cols, ok, x_ptr.dtype.element_ty)
        q = tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul_quant_row_kernel(x_ptr, q_ptr, s_ptr, d, stride_x, stride_q, FP8_MAX: tl.constexpr,
                                   BLOCK: tl.constexpr):
    """One sweep: the whole row (d <= BLOCK) in registers, read once (the two-sweep kernel reads it twice)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    y = _silu_row(x_ptr, row, stride_x, d, cols, ok, x_ptr.dtype.element_ty)
    scale = tl.maximum(tl.max(tl.where(ok, tl.abs(y), 0.0), axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    q = tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


# Rows up to this many columns take the one-sweep SiLU-and-mul quant kernel (16 warps, 32 values a thread).
SILU_ONE_SWEEP_MAX = 16384


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, FP8_MAX: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


def triton_quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch for ``kiln.ops.quant.quantize_fp8_per_token`` of a [M, K] row-major tensor."""
    if x.dim() != 2 or x.stride(-1) != 1:
        return quantize_fp8_per_token(x)
    xq = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _per_token_quant_kernel[(x.shape[0],)](x, xq, xs, x.shape[1], x.stride(0), xq.stride(0), FP8_MAX=FP8_MAX,
                                               **_row_sweep_launch(x.shape[1]))
    return xq, xs


def triton_add_rms_norm_quant_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if (x.dtype != residual.dtype or x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1
            or x.shape[1] > 16384):
        return add_rms_norm_quant_fp8_reference(x, residual, weight, eps)
    num_tokens, hidden = x.shape
    new_residual = torch.empty_like(x)
    xq = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_quant_kernel[(num_tokens,)](
            x, residual, weight.contiguous(), xq, xs, new_residual, hidden, eps,
            x.stride(0), residual.stride(0), xq.stride(0), new_residual.stride(0),
            FP8_MAX=FP8_MAX, BLOCK=block, num_warps=min(16, max(4, block // 512)),
        )
    return xq, xs, new_residual


def triton_silu_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.stride(-1) != 1:
        return silu_and_mul_quant_fp8_reference(x)
    num_tokens, d = x.shape[0], x.shape[1] // 2
    xq = torch.empty((num_tokens, d), dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens and d <= SILU_ONE_SWEEP_MAX:
        block = triton.next_power_of_2(d)
        _silu_and_mul_quant_row_kernel[(num_tokens,)](x, xq, xs, d, x.stride(0), xq.stride(0), FP8_MAX=FP8_MAX,
                                                      BLOCK=block, num_warps=min(16, max(4, block // 1024)))
    elif num_tokens:
        _silu_and_mul_quant_kernel[(num_tokens,)](x, xq, xs, d, x.stride(0), xq.stride(0), FP8_MAX=FP8_MAX,
                                                  **_row_sweep_launch(d))
    return xq, xs


def _linear_fp8_prequant(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
    if xq.device.type != "cuda":
        return linear_fp8_prequant_reference(xq, xs, w, scales, out_dtype)
    if fp8_weight_only_rows(xq, w):  # decode rows: the weight-only kernel, reading the fp8 rows as they are
        return triton_linear("fp8", xq, w, scales, -1, x_scales=xs, out_dtype=out_dtype)
    mm_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scales.float().reshape(1, -1), out_dtype=mm_dtype)
    return y.to(out_dtype)


add_rms_norm_quant_fp8, silu_and_mul_quant_fp8, linear_fp8_prequant = define_fp8_fusion_ops(
    "kiln_triton", triton_add_rms_norm_quant_fp8, triton_silu_and_mul_quant_fp8, _linear_fp8_prequant)

# Whether the joined ops quantize the rows at weight-only (decode) row counts too, as the unjoined
# fusion did (the W8A16 kernel then reads fp8 rows and their scales); off, they feed it the rows in
# the model dtype and no quantization runs. A switch for the comparison in `python -m benchmarks.offline quant-gpu`.
QUANTIZE_DECODE_ROWS = False


def joined_op_quantizes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a joined op with GEMM input rows ``x`` (or the rows that produce them) and weight ``w``
    quantizes the rows: above the weight-only rows, or always with ``QUANTIZE_DECODE_ROWS``."""
    return QUANTIZE_DECODE_ROWS or not fp8_weight_only_rows(x, w)


def _runs_triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _add_rms_norm_linear_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             w: torch.Tensor, scales: torch.Tensor,
                             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if not _runs_triton(x):
        return add_rms_norm_linear_fp8_reference(x, residual, weight, eps, w, scales, out_dtype)
    if joined_op_quantizes(x, w):
        xq, xs, new_residual = triton_add_rms_norm_quant_fp8(x, residual, weight, eps)
        return _linear_fp8_prequant(xq, xs, w, scales, out_dtype), new_residual
    normed, new_residual = triton_add_rms_norm(x, residual, weight, eps)
    return triton_linear("fp8", normed, w, scales, -1, out_dtype=out_dtype), new_residual


def _silu_and_mul_linear_fp8(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                             out_dtype: torch.dtype) -> torch.Tensor:
    if not _runs_triton(x):
        return silu_and_mul_linear_fp8_reference(x, w, scales, out_dtype)
    if joined_op_quantizes(x, w):
        xq, xs = triton_silu_and_mul_quant_fp8(x)
        return _linear_fp8_prequant(xq, xs, w, scales, out_dtype)
    return triton_linear("fp8", triton_silu_and_mul(x), w, scales, -1, out_dtype=out_dtype)


add_rms_norm_linear_fp8, silu_and_mul_linear_fp8 = define_fp8_fused_linear_ops(
    "kiln_triton", _add_rms_norm_linear_fp8, _silu_and_mul_linear_fp8)


def check_against_reference(num_tokens: int, hidden: int, intermediate: int, dtype: torch.dtype,
                            device: str, seed: int = 0) -> dict[str, float]:
    """Both kernels against the references on fresh random inputs: for the dequantized rows, the
    fraction of values that differ (rounding ties), the worst difference relative to the value
    (values near the subnormal range count against 4x the smallest normal step) and the relative L2
    error; scales relative.
    Triton's interpreter converts to fp8 a little differently from the GPU (ties, some exact powers
    of two land one binade low), so it is checked with looser bounds."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    x, res, w = randn(num_tokens, hidden), randn(num_tokens, hidden), randn(hidden)
    got_q, got_s, got_res = triton_add_rms_norm_quant_fp8(x, res, w, 1e-5)
    want_q, want_s, want_res = add_rms_norm_quant_fp8_reference(x, res, w, 1e-5)
    gu = randn(num_tokens, 2 * intermediate)
    got_sq, got_ss = triton_silu_and_mul_quant_fp8(gu)
    want_sq, want_ss = silu_and_mul_quant_fp8_reference(gu)

    def rows(q, s, wq, ws):
        a, b = q.float() * s, wq.float() * ws
        return ((a != b).float().mean().item(), ((a - b).abs() / (b.abs() + ws * 2.0 ** -4)).max().item(),
                ((a - b).norm() / b.norm()).item())

    norm, silu = rows(got_q, got_s, want_q, want_s), rows(got_sq, got_ss, want_sq, want_ss)
    return {"norm_mismatch": norm[0], "norm_rows": norm[1], "norm_l2": norm[2],
            "norm_scales": ((got_s - want_s).abs() / want_s).max().item(),
            "residual": (got_res.float() - want_res.float()).abs().max().item(),
            "silu_mismatch": silu[0], "silu_rows": silu[1], "silu_l2": silu[2],
            "silu_scales": ((got_ss - want_ss).abs() / want_ss).max().item(),
            **_check_per_token(randn(num_tokens, hidden))}


def _check_per_token(x: torch.Tensor) -> dict[str, float]:
    got_q, got_s = triton_quantize_fp8_per_token(x)
    want_q, want_s = quantize_fp8_per_token(x)
    a, b = got_q.float() * got_s, want_q.float() * want_s
    return {"quant_l2": ((a - b).norm() / b.norm()).item(),
            "quant_scales": ((got_s - want_s).abs() / want_s).max().item()}
