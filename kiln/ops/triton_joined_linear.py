"""The joined ops on CUDA: add + RMSNorm or SiLU-and-mul, then a dense, fp8 or int4 GEMM.

``kiln_cuda::add_rms_norm_linear_<scheme>`` and ``kiln_cuda::silu_and_mul_linear_<scheme>``
(schemes ``dense``, ``fp8``, ``int4``; schemas in ``kiln.ops.joined_linear``). At one row, where
the GEMM's tile is one program over all of K (the measured decode tiles), they are one kernel: the
one-row GEMV (``_channel_kernel`` for dense and fp8 weights, W8A16 with the per-channel scales
applied after the sum; ``_int4_gemv_kernel`` for int4; PDL kept) computes its input row as it
reads it (``kiln.ops.triton_quant_gemm.GemvFeed``)::

    norm:  h = x + residual (rounded to the model dtype; program 0 writes it: the new residual)
           y[n] = rsqrt(mean(h^2) + eps) * sum_k w[n, k] (h[k] gamma[k])   (* s[n] fp8, + bias[n] dense)
    silu:  y[n] = sum_k w[n, k] silu(gate[k]) up[k]   (rounded as silu_and_mul rounds)

The norm's statistics ride along the dot product, so the norm costs no launch and no extra pass
over memory (x, residual and gamma are 3 x K values every program reads from L2, against a
weight slice of BLOCK_N x K). Its one numeric difference from the unfused ops: the normed row is
never rounded to the model dtype before the GEMM (the scale comes after the sum).

Anywhere else (more rows, a split-K tile, a shape or dtype the GEMV does not take,
``kernels.dense_gemv=false``) the unfused kernels run inside the op: ``kiln_triton`` add_rms_norm or
silu_and_mul, then the scheme's GEMM (``kiln_cuda::linear_dense``'s, ``linear_int4_triton``'s);
for fp8, ``kiln_triton``'s joined op (``kiln.ops.triton_quant``: the norm / activation apart from
the weight-only GEMV up to ``FP8_TRITON_MAX_ROWS``, rows quantized to fp8 for ``_scaled_mm``
above). The choice reads the host-side row count, so a captured CUDA graph replays one fixed
kernel. Which schemes a KernelSet joins this way is ``kernels.gemv_join``'s (``kiln.ops.registry``):
dense by default, fp8 and int4 on request (their fed GEMVs measured no faster than their two
kernels on an H100).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from kiln.ops import triton_quant
from kiln.ops.dense_linear import GEMV_DTYPES, dense_linear
from kiln.ops.joined_linear import define_joined_linear_ops, joined_references
from kiln.ops.options import current
from kiln.ops.quant import (FP8_DTYPE, add_rms_norm_linear_fp8_reference, linear_int4_reference,
                            silu_and_mul_linear_fp8_reference)
from kiln.ops.quant_cuda import _linear_int4_triton
from kiln.ops.triton_norm import triton_add_rms_norm, triton_silu_and_mul
from kiln.ops.triton_quant_gemm import GemvFeed, config_for, feed_fits, triton_linear

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the fp8 and int4 GEMVs read


def _runs_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _gemv_takes(scheme: str, kind: str, k: int, dtype: torch.dtype, w: torch.Tensor, scales: Optional[torch.Tensor],
                group_size: int) -> bool:
    """Whether a fed one-row GEMV of ``scheme`` takes an input row of ``k`` values of ``dtype``."""
    if scheme == "dense":
        if (w.dtype not in GEMV_DTYPES or dtype != w.dtype or w.dim() != 2 or w.stride(1) != 1 or w.shape[1] != k
                or not current().dense_gemv):
            return False
        n = w.shape[0]
    elif scheme == "fp8":
        if (w.dtype != FP8_DTYPE or dtype not in ACTIVATION_DTYPES or w.dim() != 2 or w.stride(1) != 1
                or w.shape[1] != k or scales.dim() != 1 or scales.shape[0] != w.shape[0] or scales.stride(0) != 1
                or triton_quant.QUANTIZE_DECODE_ROWS):
            return False
        n = w.shape[0]
    else:
        if dtype not in ACTIVATION_DTYPES or scales.shape[0] * group_size != k:
            return False
        n = scales.shape[1]
    return feed_fits(scheme, config_for(scheme, 1, n, k, group_size, kind), n, k, group_size, w)


def split_gemm_args(scheme: str, gemm_args: tuple) -> tuple[
        torch.Tensor, Optional[torch.Tensor], int, Optional[torch.Tensor], Optional[torch.dtype]]:
    """(w, scales, group_size, bias, out_dtype) from the scheme's GEMM arguments."""
    if scheme == "dense":
        w, bias = gemm_args
        return w, None, 0, bias, None
    if scheme == "fp8":
        w, scales, out_dtype = gemm_args
        return w, scales, -1, None, out_dtype
    w, scales, group_size = gemm_args
    return w, scales, group_size, None, None


def _unfused_gemm(scheme: str, a: torch.Tensor, gemm_args: tuple) -> torch.Tensor:
    """The scheme's GEMM on the norm's or the activation's output, as the unjoined graph runs it at
    decode rows (fp8: the weight-only GEMV on rows in the model dtype)."""
    if scheme == "dense":
        return dense_linear(a, *gemm_args)
    if scheme == "fp8":
        w, scales, out_dtype = gemm_args
        return triton_linear("fp8", a, w, scales, -1, out_dtype=out_dtype)
    return _linear_int4_triton(a, *gemm_args)


def fuses(scheme: str, kind: str, x: torch.Tensor, gemm_args: tuple,
          norm_weight_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether a joined op of ``kind`` ("norm", "silu") with input ``x`` (the norm's x, or gate/up)
    runs the fed GEMV (one kernel) rather than the unfused kernels."""
    w, scales, group_size, bias, _ = split_gemm_args(scheme, gemm_args)
    k = x.shape[-1] // 2 if kind == "silu" else x.shape[-1]
    dtype = torch.promote_types(norm_weight_dtype or x.dtype, x.dtype)
    return (x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and (kind == "norm" or x.shape[-1] % 2 == 0)
            and _gemv_takes(scheme, kind, k, dtype, w, scales, group_size)
            and (bias is None or (bias.dtype == w.dtype and bias.dim() == 1 and bias.stride(0) == 1)))


def _fed_gemv(scheme: str, x: torch.Tensor, feed: GemvFeed, gemm_args: tuple) -> torch.Tensor:
    w, scales, group_size, bias, out_dtype = split_gemm_args(scheme, gemm_args)
    return triton_linear(scheme, x, w, scales, group_size, feed=feed, bias=bias, out_dtype=out_dtype)


def _norm_apart(scheme: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                gemm_args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    if scheme == "fp8":  # kiln_triton's joined op: rows quantized above the weight-only rows
        return triton_quant._add_rms_norm_linear_fp8(x, residual, weight, eps, *gemm_args)
    normed, new_residual = triton_add_rms_norm(x, residual, weight, eps)
    return _unfused_gemm(scheme, normed, gemm_args), new_residual


def _silu_apart(scheme: str, x: torch.Tensor, gemm_args: tuple) -> torch.Tensor:
    if scheme == "fp8":
        return triton_quant._silu_and_mul_linear_fp8(x, *gemm_args)
    return _unfused_gemm(scheme, triton_silu_and_mul(x), gemm_args)


REFERENCES = {"dense": joined_references(F.linear), "int4": joined_references(linear_int4_reference),
              "fp8": (add_rms_norm_linear_fp8_reference, silu_and_mul_linear_fp8_reference)}


def _norm_linear(scheme: str):
    reference = REFERENCES[scheme][0]

    def run(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *gemm_args):
        if not _runs_triton(x):
            return reference(x, residual, weight, eps, *gemm_args)
        if (x.dtype == residual.dtype and residual.shape == x.shape and residual.stride(-1) == 1
                and fuses(scheme, "norm", x, gemm_args, weight.dtype)):
            new_residual = torch.empty_like(x)
            feed = GemvFeed("norm", residual, weight.contiguous(), eps, new_residual)
            return _fed_gemv(scheme, x, feed, gemm_args), new_residual
        return _norm_apart(scheme, x, residual, weight, eps, gemm_args)

    return run


def _silu_linear(scheme: str):
    reference = REFERENCES[scheme][1]

    def run(x: torch.Tensor, *gemm_args):
        if not _runs_triton(x):
            return reference(x, *gemm_args)
        if fuses(scheme, "silu", x, gemm_args):
            return _fed_gemv(scheme, x, GemvFeed("silu"), gemm_args)
        return _silu_apart(scheme, x, gemm_args)

    return run


add_rms_norm_linear_dense, silu_and_mul_linear_dense = define_joined_linear_ops(
    "kiln_cuda", "dense", _norm_linear("dense"), _silu_linear("dense"))
add_rms_norm_linear_int4, silu_and_mul_linear_int4 = define_joined_linear_ops(
    "kiln_cuda", "int4", _norm_linear("int4"), _silu_linear("int4"))
add_rms_norm_linear_fp8, silu_and_mul_linear_fp8 = define_joined_linear_ops(
    "kiln_cuda", "fp8", _norm_linear("fp8"), _silu_linear("fp8"))
