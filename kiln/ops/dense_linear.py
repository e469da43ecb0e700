"""Dense (bf16 / fp16) linears at one row: ``kiln.linear_dense`` and ``kiln_cuda.linear_dense``.

At batch-1 decode every linear of a bf16 model is a GEMV: it reads its whole weight to produce one
row. cuBLAS picks tiles made for GEMMs, and at one row on an H100 they leave bandwidth unused: on
llama3-8b's shapes kiln's Triton weight-only GEMV (``kiln.ops.triton_quant_gemm``, scheme
``dense``: the fp8 kernel reading bf16 weights with no scales) took 18.8-19.1 against 20.8 us on
qkv, 13.3-13.6 against 16.7 on o, 76.9-77.3 against 82.0 on gate_up, 40.6-41.1 against 44.8 on
down and 332-334 against 373 on the LM head, and Hopper's cuBLAS splits K on two of them into a
second reduce kernel each (``python -m benchmarks.kernels quant-gemm --schemes dense``, one call per CUDA-graph
node, weights cycled past the L2).

``kiln_cuda::linear_dense(x, w, bias)`` runs that GEMV when ``x`` is one row of a CUDA bf16/fp16
weight's dtype, else ``F.linear`` (the row count is read on the host: a captured CUDA graph has
one, so it replays the kernel it was captured with). ``kiln::linear_dense`` is the reference,
``F.linear`` itself. ``DenseLinearPass`` (``kiln.passes.dense_linear``) writes the KernelSet's op
in place of a compiled graph's dense linears; the LM head, which runs outside the compiled graph,
reaches the op through ``kiln.ops.cpu_linear.decode_linear``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kiln.ops.joined_linear import define_joined_linear_ops, joined_references
from kiln.ops.library import define_op
from kiln.ops.options import current

GEMV_DTYPES = (torch.bfloat16, torch.float16)


def gemv_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the Triton GEMV takes ``x @ w.T``: one row, a CUDA weight of a GEMV dtype that x
    shares, rows of w contiguous (the kernel reads w[n, k] at n * stride + k) and as long as x's.
    Anything else goes to ``F.linear``, which also raises the error a mismatched shape deserves."""
    return (x.is_cuda and w.is_cuda and w.dtype in GEMV_DTYPES and x.dtype == w.dtype and w.dim() == 2
            and w.stride(1) == 1 and x.numel() == x.shape[-1] == w.shape[1]
            and current().dense_gemv)


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``; one row of a CUDA bf16/fp16 weight through the Triton GEMV
    (``kernels.dense_gemv=false`` keeps cuBLAS, to measure)."""
    if gemv_fits(x, w):
        from kiln.ops.triton_quant_gemm import triton_linear

        y = triton_linear("dense", x, w, None, 0)
        return y if bias is None else y + bias
    return F.linear(x, w, bias)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def _fake(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


linear_dense_reference = define_op("kiln::linear_dense", _reference, _fake)
linear_dense_cuda = define_op("kiln_cuda::linear_dense", dense_linear, _fake)
# The add + RMSNorm / SiLU-and-mul joined with it (kiln.ops.joined_linear): the references.
add_rms_norm_linear_dense, silu_and_mul_linear_dense = define_joined_linear_ops(
    "kiln", "dense", *joined_references(F.linear))
