"""Gated activation: ``torch.ops.kiln.silu_and_mul``.

``silu_and_mul(x)`` for ``x = [gate | up]`` (the output of the fused gate/up projection) returns
``silu(gate) * up``. The compiler's ``SiluMulFusionPass`` rewrites the three-op chain
``split -> silu -> mul`` into this one op, so a device with a hand-written kernel reads ``x`` once
and writes the product once.

This module holds the schema, the fake impl, the pure-torch reference (the definition kernels are
checked against) and the kernel registry: a faster kernel (Triton on GPU, ``csrc/`` on CPU)
registers itself with ``set_silu_and_mul_impl``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

SiluAndMulImpl = Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] -> [num_tokens, d]; the same ops, in the same order, as LlamaMLP."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_impl: SiluAndMulImpl = silu_and_mul_reference


def set_silu_and_mul_impl(impl: SiluAndMulImpl | None) -> None:
    """Select the kernel behind ``kiln.silu_and_mul`` (None restores the reference)."""
    global _impl
    _impl = impl or silu_and_mul_reference


def has_fast_silu_and_mul() -> bool:
    """True when a kernel faster than the reference is registered."""
    return _impl is not silu_and_mul_reference


@torch.library.custom_op("kiln::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] with d = x.shape[-1] // 2."""
    return _impl(x)


@silu_and_mul.register_fake
def _(x):
    d = x.shape[-1] // 2
    return x.new_empty((*x.shape[:-1], d))
