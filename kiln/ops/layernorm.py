"""Fused residual add + RMSNorm: ``torch.ops.kiln.add_rms_norm``.

``add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)`` with
``new_residual = residual + x`` and ``normed = weight * rms_norm(new_residual)``. Every decoder
layer does this twice (after attention and after the MLP); the compiler's
``AddRMSNormFusionPass`` rewrites the add and the six ops of the norm into this one op, so a
kernel reads the two inputs once and writes both outputs in one pass.

The op is functional (returns the new residual rather than updating ``residual`` in place): the
compiled graph stays functional and no re-inplacing pass is needed. This module holds the schema,
the fake impl and the pure-torch reference behind ``kiln::add_rms_norm``. A faster kernel defines an
op of the same schema with ``define_add_rms_norm_op``; ``kiln.ops.registry`` chooses among them.
"""

from __future__ import annotations

from typing import Callable

import torch

from kiln.ops.library import define_op

AddRMSNormImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in float32, rounded back before the weight: the numerics of kiln's RMSNorm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = residual + x
    return rms_norm_reference(new_residual, weight, eps), new_residual


def define_add_rms_norm_op(qualname: str, impl: AddRMSNormImpl):
    """Define op ``qualname`` with the schema of ``kiln::add_rms_norm``, running ``impl``."""

    def add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, new_residual = impl(x, residual, weight, eps)
        return normed, new_residual

    def fake(x, residual, weight, eps):
        residual_dtype = torch.promote_types(x.dtype, residual.dtype)
        normed = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, residual_dtype))
        return normed, x.new_empty(x.shape, dtype=residual_dtype)

    return define_op(qualname, add_rms_norm, fake)


# Returns (weight * rms_norm(residual + x), residual + x).
add_rms_norm = define_add_rms_norm_op("kiln::add_rms_norm", add_rms_norm_reference)
