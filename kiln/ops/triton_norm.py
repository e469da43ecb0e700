"""Triton kernels behind ``kiln.add_rms_norm`` and ``kiln.silu_and_mul`` on CUDA.

On CUDA the compiler's fusion passes always swap the add + RMSNorm and the silu * mul of every
layer for these two opaque ops (``kiln.passes.manager``: CUDA ops are meant to have kernels).
Without kernels the ops run their pure-torch references: about seven small launches per norm,
each a full pass over the row, which at batch 1 cost more than the layer's attention. These
kernels do each op in one pass:

    add_rms_norm    grid (num_tokens,)                one program per row, the whole row in registers
    silu_and_mul    grid (num_tokens, cdiv(d, BLOCK)) a slice of d per program

Numerics follow the references op for op: the residual sum is rounded to the input dtype, the
norm's statistics are float32, the normed row is rounded before the weight multiplies it, and
silu is rounded before the multiply by ``up``. Only the sum's order inside the mean differs.
On Hopper both launch with programmatic dependent launch (``kiln.ops.pdl``).

``check_against_reference`` compares both with the references on fresh random inputs. The ops
``kiln_triton::add_rms_norm`` and ``kiln_triton::silu_and_mul`` (the schemas of the generic ops) are
what ``kiln.ops.registry`` hands the fusion passes on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.activation import define_silu_and_mul_op, silu_and_mul_reference
from kiln.ops.layernorm import add_rms_norm_reference, define_add_rms_norm_op
from kiln.ops.pdl import pdl_args

_SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps,
                         stride_x, stride_r, stride_o, stride_nr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # kiln.ops.pdl: wait for the kernel before, let the next one's blocks launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    res = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
    r = (x.to(tl.float32) + res.to(tl.float32)).to(new_res_ptr.dtype.element_ty)  # [BLOCK]
    tl.store(new_res_ptr + row * stride_nr + cols, r, mask=ok)
    rf = r.to(tl.float32)
    inv = tl.rsqrt(tl.sum(rf * rf, axis=0) / n_cols + eps)
    y = (rf * inv).to(new_res_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def triton_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden]; weight: [hidden] -> (normed, residual + x)."""
    if x.dtype != residual.dtype or x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1:
        return add_rms_norm_reference(x, residual, weight, eps)  # shapes the kernel was not written for
    num_tokens, hidden = x.shape
    new_residual = torch.empty_like(x)
    out = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(num_tokens,)](
            x, residual, weight.contiguous(), out, new_residual, hidden, eps,
            x.stride(0), residual.stride(0), out.stride(0), new_residual.stride(0),
            BLOCK=block, num_warps=min(16, max(4, block // 512)), **pdl_args(x),
        )
    return out, new_residual


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] -> silu(x[:, :d]) * x[:, d:]."""
    if x.dim() != 2 or x.stride(-1) != 1:
        return silu_and_mul_reference(x)
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = x.new_empty((num_tokens, d))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, _SILU_BLOCK))](
            x, out, d, x.stride(0), out.stride(0), BLOCK=_SILU_BLOCK, num_warps=4, **pdl_args(x),
        )
    return out


add_rms_norm = define_add_rms_norm_op("kiln_triton::add_rms_norm", triton_add_rms_norm)
silu_and_mul = define_silu_and_mul_op("kiln_triton::silu_and_mul", triton_silu_and_mul)


def check_against_reference(num_tokens: int, hidden: int, intermediate: int, dtype: torch.dtype,
                            device: str, seed: int = 0) -> dict[str, float]:
    """Relative L2 errors of both kernels against the references on fresh random inputs."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    x, res, w = randn(num_tokens, hidden), randn(num_tokens, hidden), randn(hidden)
    got, got_res = triton_add_rms_norm(x, res, w, 1e-5)
    want, want_res = add_rms_norm_reference(x, res, w, 1e-5)
    gu = randn(num_tokens, 2 * intermediate)
    got_silu, want_silu = triton_silu_and_mul(gu), silu_and_mul_reference(gu)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    return {"add_rms_norm": rel(got, want), "residual": rel(got_res, want_res),
            "silu_and_mul": rel(got_silu, want_silu)}
