"""FP8 GEMM on CUDA (SM89+): ``kiln_cuda::linear_fp8`` through ``torch._scaled_mm``.

Activations are quantized per token on the fly (one float32 scale per row), weights carry one
float32 scale per output channel (``kiln.ops.quant.quantize_fp8``); ``_scaled_mm`` multiplies the
fp8 operands on the tensor cores, applies both scales in its epilogue and writes ``x``'s dtype.
Its shape rules: K and N multiples of 16, the weight column-major (``w.t()`` of the row-major
[N, K] weight is).
"""

from __future__ import annotations

import torch

from kiln.ops.quant import define_linear_op, linear_fp8_reference, quantize_fp8_per_token


def fp8_supported() -> bool:
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


def fp8_fits(n: int, k: int, group_size: int) -> bool:
    return n % 16 == 0 and k % 16 == 0


def _linear_fp8_scaled_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    if x.device.type != "cuda":
        return linear_fp8_reference(x, w, scales, group_size)
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_fp8_per_token(x2)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scales.float().reshape(1, -1), out_dtype=out_dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


linear_fp8_cuda = define_linear_op("kiln_cuda::linear_fp8", _linear_fp8_scaled_mm, lambda w: w.shape[0])
