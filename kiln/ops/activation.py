"""Gated activation: ``torch.ops.kiln.silu_and_mul``.

``silu_and_mul(x)`` for ``x = [gate | up]`` (the output of the fused gate/up projection) returns
``silu(gate) * up``. The compiler's ``SiluMulFusionPass`` rewrites the three-op chain
``split -> silu -> mul`` into this one op, so a device with a hand-written kernel reads ``x`` once
and writes the product once.

This module holds the schema, the fake impl and the pure-torch reference (the definition kernels are
checked against) behind ``kiln::silu_and_mul``. A faster kernel (Triton on GPU) defines an op of the
same schema with ``define_silu_and_mul_op``; ``kiln.ops.registry`` chooses which op the pass writes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kiln.ops.library import define_op

SiluAndMulImpl = Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] -> [num_tokens, d]; the same ops, in the same order, as LlamaMLP."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def define_silu_and_mul_op(qualname: str, impl: SiluAndMulImpl):
    """Define op ``qualname`` with the schema of ``kiln::silu_and_mul``, running ``impl``."""

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return impl(x)

    def fake(x):
        d = x.shape[-1] // 2
        return x.new_empty((*x.shape[:-1], d))

    return define_op(qualname, silu_and_mul, fake)


# silu(x[..., :d]) * x[..., d:] with d = x.shape[-1] // 2.
silu_and_mul = define_silu_and_mul_op("kiln::silu_and_mul", silu_and_mul_reference)
