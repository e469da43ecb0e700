"""CPU decode GEMMs: one-row bfloat16 linears through kiln's AVX512-BF16 GEMV.

At batch-1 decode every linear is ``[1, K] @ W.T``, and the step streams every weight once. On
the CPU, torch's one-row bfloat16 paths do not read faster than float32: ``F.linear`` sends the row
through oneDNN's matmul and ``torch.mv`` through a GEMV that converts each bfloat16 to float; on a
2-core Xeon with AMX-BF16 both take about as long as float32's MKL GEMV on twice the bytes, so a
bfloat16 model decoded no faster than float32. ``torch.ops.kiln_cpu.gemv_bf16`` (``csrc/gemv.cpp``,
built into ``kiln._C``) multiplies bfloat16 pairs with AVX512-BF16 into float32 sums and
prefetches ahead: about 2x float32 per step (``benchmarks/quant_cpu.py``). More rows keep
``F.linear``: oneDNN's AMX kernels win from a few rows on (batch 16: 2.5x float32 on the LM head).
``torch.ops.kiln_cpu.linear_bf16`` makes that choice in C++ by the row count, so a compiled graph
holds it as one opaque op and serves decode and prefill alike. Without the extension, one eager row
goes through ``torch.mv`` (no worse than ``F.linear``).

``decode_linear`` is that choice; ``use_decode_gemv`` switches a CPU model's bfloat16 ``nn.Linear``
layers to it (``GemvLinear``), and ``prepare_cpu_decode`` also gives a quantized float32 model a
bfloat16 LM head.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# Weight dtypes whose one-row product goes through the GEMV (float32's MKL GEMV is already at
# memory speed).
GEMV_DTYPES = (torch.bfloat16,)
_gemv_loaded: Optional[bool] = None  # None: not tried yet


def gemv_available() -> bool:
    """Whether ``kiln._C`` is built with the GEMV ops (``torch.ops.kiln_cpu.gemv_bf16``,
    ``linear_bf16``, ``linear_int4_packed``)."""
    global _gemv_loaded
    if _gemv_loaded is None:
        from kiln.ops.cpu_attention import load_extension

        _gemv_loaded = load_extension() and hasattr(torch.ops.kiln_cpu, "linear_bf16")
        if _gemv_loaded:
            _register_fakes()
    return _gemv_loaded


def _register_fakes() -> None:
    @torch.library.register_fake("kiln_cpu::gemv_bf16")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("kiln_cpu::linear_bf16")
    def _(x, w, bias=None):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("kiln_cpu::linear_int4_packed")
    def _(x, w, scales_zeros, group_size):
        return x.new_empty((*x.shape[:-1], scales_zeros.shape[1]))


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T`` in float32 from bfloat16 ``w`` (``x`` rounded to bfloat16)."""
    x = x.to(torch.bfloat16)
    if gemv_available():
        return torch.ops.kiln_cpu.gemv_bf16(x, w)
    return torch.stack([torch.mv(w, row).float() for row in x]) if x.shape[0] else x.new_empty((0, w.shape[0]),
                                                                                               dtype=torch.float32)


def decode_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` in ``x``'s dtype; for a CPU weight of a GEMV dtype through
    ``torch.ops.kiln_cpu.linear_bf16`` (one row: the GEMV; more: ``F.linear``), in eager mode and in
    compiled graphs alike; without the extension, one eager row through ``torch.mv``. A CUDA
    bf16/fp16 weight goes through ``kiln_cuda::linear_dense`` (``kiln.ops.dense_linear``: the
    Triton GEMV at one row, cuBLAS above)."""
    if w.dtype in GEMV_DTYPES and w.device.type == "cpu":
        if gemv_available():
            return torch.ops.kiln_cpu.linear_bf16(x, w, bias)
        if x.dim() == 2 and x.shape[0] == 1 and not torch.compiler.is_compiling():
            y = torch.mv(w, x[0].to(w.dtype)).unsqueeze(0).to(x.dtype)
            return y if bias is None else y + bias
    if w.is_cuda and w.dtype in (torch.bfloat16, torch.float16):
        from kiln.ops import dense_linear  # noqa: F401  (defines the op)

        return torch.ops.kiln_cuda.linear_dense(x.to(w.dtype), w, bias).to(x.dtype)
    return F.linear(x.to(w.dtype), w, bias).to(x.dtype)


def linear_int4_eager():
    """What an eager int4 ``QuantLinear`` on the CPU calls: the C++ wrapper of torch's packed int4
    GEMM when built (one dispatcher call), else the Python one."""
    from kiln.ops import quant

    return torch.ops.kiln_cpu.linear_int4_packed if gemv_available() else quant._linear_int4_cpu


class GemvLinear(nn.Linear):
    """An ``nn.Linear`` whose calls go through ``decode_linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decode_linear(x, self.weight, self.bias)


def use_decode_gemv(model: nn.Module) -> int:
    """Switch every ``nn.Linear`` of a CPU model whose weight is a GEMV dtype to ``GemvLinear`` in
    place (same parameters); returns how many."""
    count = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in GEMV_DTYPES:
            m.__class__ = GemvLinear
            count += 1
    return count


def prepare_cpu_decode(model: nn.Module) -> None:
    """Decode GEMMs of a loaded CPU model: ``GemvLinear`` for its bfloat16 linears, and for a model
    whose decoder linears are quantized (their kernels compute in bfloat16, ``kiln.ops.quant``) a
    bfloat16 copy of the LM head weight (``model.head_weight``, read by ``compute_logits``), which
    halves the largest read of a float32 model's step; a quantized GGUF's embedding is Q8_0, whose
    values bfloat16 holds to 2^-9 relative."""
    use_decode_gemv(model)
    if getattr(model, "quantization", "none") in ("int8", "int4") and hasattr(model, "embed_tokens"):
        head = model.embed_tokens.weight if getattr(model, "lm_head", None) is None else model.lm_head.weight
        if head.device.type == "cpu" and head.dtype == torch.float32:
            model.head_weight = head.detach().to(torch.bfloat16)
