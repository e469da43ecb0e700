"""A GEMM joined with the op that feeds it: the op schemas, the fake impls and the references.

Before every GEMM of a decoder layer but o_proj stands a small op whose output only that GEMM
reads: the residual add + RMSNorm before q/k/v and gate/up, SiLU-and-mul before down_proj.
``GemmInputFusionPass`` (``kiln.passes.gemm_input_fusion``) writes one op for each such pair, so a
kernel may compute the GEMM's input as it reads it (kiln's one-row GEMVs do: no launch and no
round trip through memory for the norm or the activation)::

    add_rms_norm_linear_<scheme>(x, residual, weight, eps, *gemm_args) -> (y, residual + x)
    silu_and_mul_linear_<scheme>(x, *gemm_args) -> y

``gemm_args`` are the GEMM's own arguments after its input, per scheme (``GEMMS``): ``dense``
``(w, bias)`` as ``linear_dense``; ``int4`` ``(w, scales_zeros, group_size)`` as ``linear_int4``;
``fp8`` ``(w, scales, out_dtype)`` (the output dtype, as its joined ops have always taken it).
``define_joined_linear_ops`` defines the pair of one scheme in a namespace from two kernels; the
``kiln::`` references (``joined_references`` of the scheme's GEMM reference, defined beside it in
``kiln.ops.dense_linear`` and ``kiln.ops.quant``) compute what the unfused ops compute. Which
kernel ops a graph gets is the ``KernelSet``'s choice (``kiln.ops.registry``: ``joined_<scheme>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kiln.ops.activation import silu_and_mul_reference
from kiln.ops.layernorm import add_rms_norm_reference
from kiln.ops.library import define_op


@dataclass(frozen=True)
class JoinedGemm:
    """One scheme's GEMM as a joined op takes it."""

    args_schema: str  # the schema of ``gemm_args``
    # (the GEMM input's dtype, *gemm_args) -> (out_features, output dtype)
    output: Callable[..., tuple[int, torch.dtype]]


GEMMS: dict[str, JoinedGemm] = {
    "dense": JoinedGemm("Tensor w, Tensor? bias", lambda dtype, w, bias: (w.shape[0], dtype)),
    "int4": JoinedGemm("Tensor w, Tensor scales, int group_size", lambda dtype, w, sz, g: (sz.shape[1], dtype)),
    "fp8": JoinedGemm("Tensor w, Tensor scales, ScalarType out_dtype", lambda dtype, w, s, out: (w.shape[0], out)),
}


def joined_references(gemm: Callable[..., torch.Tensor]) -> tuple[Callable, Callable]:
    """The references of the two joined ops of a GEMM whose reference is ``gemm(a, *gemm_args)``:
    the unfused references, one after the other."""

    def norm_linear(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *gemm_args):
        normed, new_residual = add_rms_norm_reference(x, residual, weight, eps)
        return gemm(normed, *gemm_args), new_residual

    def silu_linear(x: torch.Tensor, *gemm_args):
        return gemm(silu_and_mul_reference(x), *gemm_args)

    return norm_linear, silu_linear


def define_joined_linear_ops(namespace: str, scheme: str, norm_linear: Callable, silu_linear: Callable) -> tuple:
    """``namespace::add_rms_norm_linear_<scheme>`` running ``norm_linear(x, residual, weight, eps,
    *gemm_args) -> (y, new_residual)`` and ``namespace::silu_and_mul_linear_<scheme>`` running
    ``silu_linear(x, *gemm_args) -> y``."""
    gemm = GEMMS[scheme]

    def norm_kernel(*args) -> tuple[torch.Tensor, torch.Tensor]:
        y, new_residual = norm_linear(*args)
        return y, new_residual

    def silu_kernel(*args) -> torch.Tensor:
        return silu_linear(*args)

    def norm_fake(x, residual, weight, eps, *gemm_args):
        residual_dtype = torch.promote_types(x.dtype, residual.dtype)
        n, dtype = gemm.output(torch.promote_types(weight.dtype, residual_dtype), *gemm_args)
        return x.new_empty((*x.shape[:-1], n), dtype=dtype), x.new_empty(x.shape, dtype=residual_dtype)

    def silu_fake(x, *gemm_args):
        n, dtype = gemm.output(x.dtype, *gemm_args)
        return x.new_empty((*x.shape[:-1], n), dtype=dtype)

    norm_schema = f"(Tensor x, Tensor residual, Tensor weight, float eps, {gemm.args_schema}) -> (Tensor, Tensor)"
    return (define_op(f"{namespace}::add_rms_norm_linear_{scheme}", norm_kernel, norm_fake, schema=norm_schema),
            define_op(f"{namespace}::silu_and_mul_linear_{scheme}", silu_kernel, silu_fake,
                      schema=f"(Tensor x, {gemm.args_schema}) -> Tensor"))
