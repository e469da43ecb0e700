"""Quantized linear layers: weight formats, the generic ops (pure-torch references) and the CPU kernels.

Three schemes, each a weight format and a GEMM ``op(x, w, scales, group_size) -> y`` computing
``x @ dequant(w).T`` in ``x``'s dtype:

    scheme  canonical weight ``w``                       ``scales``                       dequant
    int8    int8 [N, K]                                  [N] (model dtype)                w * s
    int4    uint8 [N, K/2]: k even low nibble, odd high  [K/g, N, 2] (model dtype): s, z  (q - 8) * s + z
    fp8     float8_e4m3fn [N, K]                         [N] float32                       w * s

int8 and int4 are weight-only (activations stay in the model dtype, accumulation in float32);
fp8 also quantizes the activations, per token and dynamically (``x / (amax(|x|) / 448)``), and
multiplies fp8 by fp8. The int4 convention (offset 8, a zero point per group) is the one of
torch's packed int4 kernels, so a GGUF Q4_1 block (``q * d + m``) is exactly ``s = d, z = m + 8d``.

A kernel may store the weight in its own layout (torch's CPU int4 kernel wants its blocked
packing): each ``QuantLinearKernel`` (``kiln.ops.registry``) has ``pack`` (canonical -> its
layout), ``op`` and ``dequant`` (its layout -> the full weight). A quantized model calls ``op`` in
eager mode; under compilation it writes ``linear(x, dequant(w, ...))`` and ``QuantLinearPass``
(``kiln.passes.quant_linear``) swaps that pair for ``op``, so a graph without the pass is still
correct. Every op of one scheme has the schema of the generic one (``kiln::linear_<scheme>``,
``kiln::dequant_<scheme>``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kiln.ops.joined_linear import define_joined_linear_ops, joined_references
from kiln.ops.library import define_op

SCHEMES = ("int8", "int4", "fp8")
INT4_GROUP_SIZE = 32  # GGUF's block size, and a multiple of torch's int4 kernel's tile
FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn

# Up to this many rows the Triton W8A16 kernel beats per-token quantization + ``_scaled_mm`` on an
# H100 at the llama3-8b shapes (python -m benchmarks.kernels quant-gemm: at 32 rows it is 3-40% faster, at 64
# slower on two of the four).
FP8_TRITON_MAX_ROWS = 32


def fp8_fits(n: int, k: int, group_size: int) -> bool:
    """Whether ``_scaled_mm`` takes an [n, k] FP8 weight."""
    return n % 16 == 0 and k % 16 == 0


def fp8_weight_only_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether an FP8 GEMM of input ``x`` and weight ``w`` runs the weight-only kernel (decode rows,
    or a shape ``_scaled_mm`` cannot take) rather than per-token quantization + ``_scaled_mm``."""
    rows = x.numel() // max(x.shape[-1], 1)
    return rows <= FP8_TRITON_MAX_ROWS or not fp8_fits(w.shape[0], w.shape[1], -1)


# ---- quantizers (canonical formats) ---------------------------------------------------------------

def quantize_int8(w: torch.Tensor, scale_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 [N, K], scales [N])."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(scale_dtype or w.dtype)


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE,
                  scale_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 with a scale and a zero point per group of ``group_size`` input columns:
    (uint8 [N, K/2] packed nibbles, scales_zeros [K/g, N, 2])."""
    n, k = w.shape
    check_int4_shape(n, k, group_size)
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, K/g]
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    zeros = lo + 8.0 * scales
    return pack_int4(q), int4_scales_zeros(scales, zeros, scale_dtype or w.dtype)


def int4_scales_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K/g] scales and zeros -> the [K/g, N, 2] tensor the int4 ops take."""
    return torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel float8_e4m3fn: (fp8 [N, K], float32 scales [N])."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (wf / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row fp8 of activations: (fp8 [M, K], float32 scales [M, 1])."""
    xf = x.float()
    scales = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def check_int4_shape(n: int, k: int, group_size: int) -> None:
    if group_size <= 0 or k % group_size or group_size % 2:
        raise ValueError(f"int4 quantization needs in_features ({k}) to be a multiple of an even group_size "
                         f"({group_size})")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> [N, K/2], column 2i in the low nibble and 2i+1 in the high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(w: torch.Tensor) -> torch.Tensor:
    """[N, K/2] packed -> uint8 values 0..15 [N, K]."""
    return torch.stack((w & 0xF, w >> 4), dim=-1).reshape(w.shape[0], -1)


# ---- references (the generic ops) --------------------------------------------------------------

def dequant_int8_reference(w: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    return (w.float() * scales.float()[:, None]).to(dtype)


def dequant_int4_reference(w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                           dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(w).float()  # [N, K]
    s = scales_zeros[..., 0].float().t().repeat_interleave(group_size, dim=1)  # [N, K]
    z = scales_zeros[..., 1].float().t().repeat_interleave(group_size, dim=1)
    return ((q - 8.0) * s + z).to(dtype)


def dequant_fp8_reference(w: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    return (w.float() * scales.float()[:, None]).to(dtype)


def linear_int8_reference(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return (x.float() @ dequant_int8_reference(w, scales, group_size, torch.float32).t()).to(x.dtype)


def linear_int4_reference(x: torch.Tensor, w: torch.Tensor, scales_zeros: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    return (x.float() @ dequant_int4_reference(w, scales_zeros, group_size, torch.float32).t()).to(x.dtype)


def linear_fp8_reference(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp8 x fp8 with per-token activation scales and per-channel weight scales, float32 accumulation."""
    xq, xs = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
    y = (xq.float() @ w.float().t()) * xs * scales.float()[None, :]
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


# ---- op definitions ----------------------------------------------------------------------------

LinearImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
DequantImpl = Callable[[torch.Tensor, torch.Tensor, int, torch.dtype], torch.Tensor]


def define_linear_op(qualname: str, impl: LinearImpl, out_features: Callable[[torch.Tensor, torch.Tensor], int]):
    """Op ``qualname(x, w, scales, group_size) -> y`` running ``impl``; ``out_features(w, scales)`` is N."""

    def linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
        return impl(x, w, scales, group_size)

    def fake(x, w, scales, group_size):
        return x.new_empty((*x.shape[:-1], out_features(w, scales)))

    return define_op(qualname, linear, fake)


def define_dequant_op(qualname: str, impl: DequantImpl, shape: Callable[[torch.Tensor, torch.Tensor, int], tuple]):
    """Op ``qualname(w, scales, group_size, dtype) -> the full weight [N, K]``."""

    def dequant(w: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
        return impl(w, scales, group_size, dtype)

    def fake(w, scales, group_size, dtype):
        return w.new_empty(shape(w, scales, group_size), dtype=dtype)

    return define_op(qualname, dequant, fake)


def _rows(w: torch.Tensor, scales: torch.Tensor) -> int:
    return w.shape[0]


def _int4_sz_rows(w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> tuple:
    # Read from the scales: kernels' packed layouts may have any shape.
    return (scales_zeros.shape[1], scales_zeros.shape[0] * group_size)


def _int4_out_features(w: torch.Tensor, scales_zeros: torch.Tensor) -> int:
    return scales_zeros.shape[1]


def _same_shape(w: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple:
    return tuple(w.shape)


linear_int8 = define_linear_op("kiln::linear_int8", linear_int8_reference, _rows)
linear_int4 = define_linear_op("kiln::linear_int4", linear_int4_reference, _int4_out_features)
linear_fp8 = define_linear_op("kiln::linear_fp8", linear_fp8_reference, _rows)
dequant_int8 = define_dequant_op("kiln::dequant_int8", dequant_int8_reference, _same_shape)
dequant_int4 = define_dequant_op("kiln::dequant_int4", dequant_int4_reference, _int4_sz_rows)
dequant_fp8 = define_dequant_op("kiln::dequant_fp8", dequant_fp8_reference, _same_shape)


# ---- CPU kernels (torch's packed weight-only GEMMs) ----------------------------------------------

def cpu_int4_supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def cpu_int8_supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def cpu_int4_fits(n: int, k: int, group_size: int) -> bool:
    """Shapes torch's CPU int4 kernel takes: N a multiple of 16 (its row tile), K of the group."""
    return n % 16 == 0 and k % group_size == 0 and group_size in (32, 64, 128, 256)


# torch's packed CPU GEMMs are fast only with bfloat16 activations and scales (their float32 and
# float16 paths are scalar loops, 10-50x slower): the CPU kernels keep scales in bfloat16 and run a
# float32 model's activations through them in bfloat16, accumulating in float32.
CPU_COMPUTE_DTYPE = torch.bfloat16


def pack_int8_cpu(w: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return w, scales.to(CPU_COMPUTE_DTYPE)


def pack_int4_cpu(w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical int4 -> the blocked layout of ``aten._weight_int4pack_mm_for_cpu``."""
    q = unpack_int4(w).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    return packed, scales_zeros.to(CPU_COMPUTE_DTYPE)


def _linear_int8_cpu(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).to(scales.dtype).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(x2, w, scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def _linear_int4_cpu(x: torch.Tensor, w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).to(scales_zeros.dtype).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w, group_size, scales_zeros)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def _dequant_int4_cpu(w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    # The blocked layout is torch's own: read it back through the kernel (identity @ W.T).
    k = w.shape[1] * 2
    eye = torch.eye(k, dtype=scales_zeros.dtype, device=w.device)  # one product per output, rounded once
    return _linear_int4_cpu(eye, w, scales_zeros, group_size).t().contiguous().to(dtype)


linear_int8_cpu = define_linear_op("kiln_cpu::linear_int8", _linear_int8_cpu, _rows)
linear_int4_cpu = define_linear_op("kiln_cpu::linear_int4", _linear_int4_cpu, _int4_out_features)
dequant_int4_cpu = define_dequant_op("kiln_cpu::dequant_int4", _dequant_int4_cpu, _int4_sz_rows)


def dequant_reference(scheme: str) -> DequantImpl:
    return {"int8": dequant_int8_reference, "int4": dequant_int4_reference, "fp8": dequant_fp8_reference}[scheme]


def linear_reference(scheme: str) -> LinearImpl:
    return {"int8": linear_int8_reference, "int4": linear_int4_reference, "fp8": linear_fp8_reference}[scheme]


# ---- FP8 activation quantization fused into the op that produces the activation --------------------
# The fusion pass (``kiln.passes.gemm_input_fusion``) turns ``linear_fp8(rms_norm(...))`` and
# ``linear_fp8(silu_and_mul(...))`` into one op that normalizes (or gates) and quantizes each row,
# and a GEMM on the already-quantized rows. The references compute exactly what the unfused ops do.

def add_rms_norm_quant_fp8_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 rows of weight * rms_norm(residual + x), their float32 scales [T, 1], residual + x)."""
    from kiln.ops.layernorm import add_rms_norm_reference

    normed, new_residual = add_rms_norm_reference(x, residual, weight, eps)
    xq, xs = quantize_fp8_per_token(normed)
    return xq, xs, new_residual


def silu_and_mul_quant_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 rows of silu(x[:, :d]) * x[:, d:] and their float32 scales [T, 1]."""
    from kiln.ops.activation import silu_and_mul_reference

    return quantize_fp8_per_token(silu_and_mul_reference(x))


def linear_fp8_prequant_reference(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                                  out_dtype: torch.dtype) -> torch.Tensor:
    """``linear_fp8`` on rows already quantized: (xq * xs) @ (w * scales).T in ``out_dtype``."""
    return ((xq.float() @ w.float().t()) * xs * scales.float()[None, :]).to(out_dtype)


def define_fp8_fusion_ops(namespace: str, add_rms_norm_quant, silu_and_mul_quant, linear_prequant) -> tuple:
    """The three ops of the FP8 activation fusion in ``namespace`` (``kiln``: the references)."""

    def add_rms_norm_quant_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xq, xs, new_residual = add_rms_norm_quant(x, residual, weight, eps)
        return xq, xs, new_residual

    def silu_and_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xq, xs = silu_and_mul_quant(x)
        return xq, xs

    def linear_fp8_prequant(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
        return linear_prequant(xq, xs, w, scales, out_dtype)

    def norm_fake(x, residual, weight, eps):
        rows = x.shape[0]
        return (x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((rows, 1), dtype=torch.float32),
                x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype)))

    def silu_fake(x):
        d = x.shape[-1] // 2
        return x.new_empty((x.shape[0], d), dtype=FP8_DTYPE), x.new_empty((x.shape[0], 1), dtype=torch.float32)

    def gemm_fake(xq, xs, w, scales, out_dtype):
        return xq.new_empty((xq.shape[0], w.shape[0]), dtype=out_dtype)

    return (define_op(f"{namespace}::add_rms_norm_quant_fp8", add_rms_norm_quant_fp8, norm_fake),
            define_op(f"{namespace}::silu_and_mul_quant_fp8", silu_and_mul_quant_fp8, silu_fake),
            define_op(f"{namespace}::linear_fp8_prequant", linear_fp8_prequant, gemm_fake))


add_rms_norm_quant_fp8, silu_and_mul_quant_fp8, linear_fp8_prequant = define_fp8_fusion_ops(
    "kiln", add_rms_norm_quant_fp8_reference, silu_and_mul_quant_fp8_reference, linear_fp8_prequant_reference)


# ---- the FP8 GEMM joined with the op that feeds it ---------------------------------------------------
# What ``GemmInputFusionPass`` writes: one op for "add + RMSNorm -> FP8 GEMM" and one for "SiLU-and-mul
# -> FP8 GEMM". The op, not the graph, picks the kernels by the row count it is called with (the
# dynamic build serves decode and prefill alike): at weight-only rows (``fp8_weight_only_rows``) the
# plain norm / activation and the W8A16 GEMM, which reads the rows in the model dtype, so no
# activation quantization runs; above, the norm / activation that writes fp8 rows and their scales,
# and the GEMM on those rows. The references compute what the unfused ops do.

def add_rms_norm_linear_fp8_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                      w: torch.Tensor, scales: torch.Tensor,
                                      out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear_fp8(weight * rms_norm(residual + x)) in ``out_dtype``, residual + x)."""
    from kiln.ops.layernorm import add_rms_norm_reference

    normed, new_residual = add_rms_norm_reference(x, residual, weight, eps)
    return linear_fp8_reference(normed, w, scales, -1).to(out_dtype), new_residual


def silu_and_mul_linear_fp8_reference(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                                      out_dtype: torch.dtype) -> torch.Tensor:
    """linear_fp8(silu(x[:, :d]) * x[:, d:]) in ``out_dtype``."""
    from kiln.ops.activation import silu_and_mul_reference

    return linear_fp8_reference(silu_and_mul_reference(x), w, scales, -1).to(out_dtype)


def define_fp8_fused_linear_ops(namespace: str, norm_linear, silu_linear) -> tuple:
    """``namespace::add_rms_norm_linear_fp8`` and ``namespace::silu_and_mul_linear_fp8`` (the joined
    ops of every scheme are defined alike: ``kiln.ops.joined_linear``)."""
    return define_joined_linear_ops(namespace, "fp8", norm_linear, silu_linear)


add_rms_norm_linear_fp8, silu_and_mul_linear_fp8 = define_fp8_fused_linear_ops(
    "kiln", add_rms_norm_linear_fp8_reference, silu_and_mul_linear_fp8_reference)
# int4's joined ops (``kiln.ops.joined_linear``): the references.
add_rms_norm_linear_int4, silu_and_mul_linear_int4 = define_joined_linear_ops(
    "kiln", "int4", *joined_references(linear_int4_reference))
