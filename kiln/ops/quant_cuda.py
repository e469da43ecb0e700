"""Quantized GEMMs on CUDA: ``kiln_cuda::linear_fp8`` (SM89+), ``linear_int8`` and ``linear_int4``.

FP8 at up to ``FP8_TRITON_MAX_ROWS`` rows (decode): the Triton weight-only kernel
(``kiln.ops.triton_quant_gemm``) reads the fp8 weight and multiplies it by the activations in the
model dtype (no activation quantization). Above that, ``torch._scaled_mm``: activations are
quantized per token on the fly (one float32 scale per row), weights carry one float32 scale per
output channel (``kiln.ops.quant.quantize_fp8``); ``_scaled_mm`` multiplies the fp8 operands on
the tensor cores, applies both scales in its epilogue and writes ``x``'s dtype. Its shape rules: K
and N multiples of 16, the weight column-major (``w.t()`` of the row-major [N, K] weight is);
other shapes take the Triton kernel at every row count. The choice reads the host-side row count,
so a captured CUDA graph (one row count) always replays the kernel it was captured with.

int8 and int4 (canonical layouts, group scales): the Triton kernels up to ``INT_TRITON_MAX_ROWS``
(int4: ``INT4_TRITON_MAX_ROWS``) rows; above, the weight is dequantized to the model dtype (int4: one Triton launch) and multiplied
by cuBLAS, which at prefill row counts costs less than dequantizing inside the GEMM's tiles.
torch's int4 tinygemm (``aten._weight_int4pack_mm``, its own tiled layout) is the ``tinygemm``
kernel.
"""

from __future__ import annotations

import torch

from kiln.ops.quant import (FP8_TRITON_MAX_ROWS, define_dequant_op, define_linear_op, fp8_fits,  # noqa: F401
                            fp8_weight_only_rows, linear_fp8_reference, quantize_fp8_per_token)


def fp8_supported() -> bool:
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 of the GEMM's input: one Triton launch where Triton is installed."""
    try:
        from kiln.ops.triton_quant import triton_quantize_fp8_per_token
    except ImportError:
        return quantize_fp8_per_token(x)
    return triton_quantize_fp8_per_token(x)


def _linear_fp8_scaled_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    if x.device.type != "cuda":
        return linear_fp8_reference(x, w, scales, group_size)
    if fp8_weight_only_rows(x, w):
        from kiln.ops.triton_quant_gemm import triton_linear

        return triton_linear("fp8", x, w, scales, group_size)
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = _quantize_rows(x2)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scales.float().reshape(1, -1), out_dtype=out_dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


linear_fp8_cuda = define_linear_op("kiln_cuda::linear_fp8", _linear_fp8_scaled_mm, lambda w, scales: w.shape[0])


# ---- int4 weight-only: torch's tinygemm kernel (``aten._weight_int4pack_mm``, bf16) -----------------
INT4_INNER_K_TILES = 8
_nibble_order: dict[str, bool] = {}  # device -> "even column in the high nibble" for the packer


def int4_supported() -> bool:
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_weight_int4pack_mm") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack")


def int4_fits(n: int, k: int, group_size: int) -> bool:
    return n % 8 == 0 and k % (INT4_INNER_K_TILES * 16) == 0 and group_size in (32, 64, 128, 256)


def _pack_with(q: torch.Tensor, even_high: bool) -> torch.Tensor:
    q = q.to(torch.uint8)
    pairs = (q[:, 0::2] << 4) | q[:, 1::2] if even_high else q[:, 0::2] | (q[:, 1::2] << 4)
    return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), INT4_INNER_K_TILES)


def _even_high(device: torch.device) -> bool:
    """Which nibble order torch's packer reads, found once per device on a small weight (it has
    changed across releases): the one whose GEMM reproduces the reference."""
    key = str(device)
    if key not in _nibble_order:
        from kiln.ops.quant import dequant_int4_reference, quantize_int4, unpack_int4

        gen = torch.Generator().manual_seed(0)
        w = torch.randn(64, 256, generator=gen).to(device)
        packed, sz = quantize_int4(w, 32, torch.bfloat16)
        x = torch.eye(256, dtype=torch.bfloat16, device=device)[:64]
        want = x.float() @ dequant_int4_reference(packed, sz, 32, torch.float32).t()
        for even_high in (True, False):
            got = torch.ops.aten._weight_int4pack_mm(x, _pack_with(unpack_int4(packed), even_high), 32, sz)
            if torch.allclose(got.float(), want, atol=1e-2, rtol=1e-2):
                _nibble_order[key] = even_high
                break
        else:
            raise RuntimeError("torch's int4 packer matches neither nibble order; use model.quantization=int8")
    return _nibble_order[key]


def pack_int4_cuda(w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical int4 -> the tiled layout of ``aten._weight_int4pack_mm`` (bf16 scales)."""
    from kiln.ops.quant import unpack_int4

    return _pack_with(unpack_int4(w), _even_high(w.device)), scales_zeros.to(torch.bfloat16).contiguous()


def _linear_int4_cuda(x: torch.Tensor, w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm(x2, w, group_size, scales_zeros)
    return y.to(x.dtype).reshape(*x.shape[:-1], scales_zeros.shape[1])


def _dequant_int4_cuda(w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
    k = scales_zeros.shape[0] * group_size
    eye = torch.eye(k, dtype=torch.bfloat16, device=w.device)  # the tiled layout read back through the kernel
    return _linear_int4_cuda(eye, w, scales_zeros, group_size).t().contiguous().to(dtype)


def _int4_shape(w: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> tuple:
    return (scales_zeros.shape[1], scales_zeros.shape[0] * group_size)


linear_int4_cuda = define_linear_op("kiln_cuda::linear_int4", _linear_int4_cuda, lambda w, sz: sz.shape[1])
dequant_int4_cuda = define_dequant_op("kiln_cuda::dequant_int4", _dequant_int4_cuda, _int4_shape)


# ---- int8 / int4 weight-only: the Triton kernels, canonical layouts ----------------------------------

def triton_supported() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def int4_triton_fits(n: int, k: int, group_size: int) -> bool:
    return group_size % 2 == 0 and group_size >= 2 and k % group_size == 0


# Above this many rows the int8 weight is dequantized for a dense GEMM (H100, llama3-8b shapes:
# dequantizing in the tiles is ALU-bound, at 32 rows 2-4x slower than bf16 cuBLAS).
INT_TRITON_MAX_ROWS = 16
# int4's tensor-core tile (bf16x2 dequantization) beats dequantization + cuBLAS at 32 and 64 rows on
# all four llama3-8b shapes (H100: 1.3-2.2x, benchmarks/results/kernels-H100.md#quant_gemm-int4); above, unmeasured.
INT4_TRITON_MAX_ROWS = 64


def _dense_rows(x: torch.Tensor, max_rows: int = INT_TRITON_MAX_ROWS) -> bool:
    return x.numel() // max(x.shape[-1], 1) > max_rows


def _linear_int8_triton(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    from kiln.ops.quant import linear_int8_reference

    if x.device.type != "cuda":
        return linear_int8_reference(x, w, scales, group_size)
    if _dense_rows(x):
        return _dense_int8(x, w, scales)
    from kiln.ops.triton_quant_gemm import triton_linear

    return triton_linear("int8", x, w, scales, group_size)


DENSE_CHUNK_BYTES = 64 << 20


def _dense_int8(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ (w * scales).T through cuBLAS, dequantizing at most ``DENSE_CHUNK_BYTES`` of weight
    rows at a time: an int8 LM head (128k rows) would otherwise need a 1 GB temporary."""
    rows = max(1, DENSE_CHUNK_BYTES // (w.shape[1] * x.element_size()))
    if rows >= w.shape[0]:
        return torch.nn.functional.linear(x, w.to(x.dtype) * scales.to(x.dtype)[:, None])
    return torch.cat([torch.nn.functional.linear(x, w[i:i + rows].to(x.dtype) * scales[i:i + rows].to(x.dtype)[:, None])
                      for i in range(0, w.shape[0], rows)], dim=-1)


def _linear_int4_triton(x: torch.Tensor, w: torch.Tensor, scales_zeros: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    from kiln.ops.quant import linear_int4_reference

    if x.device.type != "cuda":
        return linear_int4_reference(x, w, scales_zeros, group_size)
    from kiln.ops.triton_quant_gemm import triton_dequant_int4, triton_linear

    if _dense_rows(x, INT4_TRITON_MAX_ROWS):
        return torch.nn.functional.linear(x, triton_dequant_int4(w, scales_zeros, group_size, x.dtype))

    return triton_linear("int4", x, w, scales_zeros, group_size)


linear_int8_triton = define_linear_op("kiln_cuda::linear_int8", _linear_int8_triton, lambda w, scales: w.shape[0])
linear_int4_triton = define_linear_op("kiln_cuda::linear_int4_triton", _linear_int4_triton,
                                      lambda w, sz: sz.shape[1])
