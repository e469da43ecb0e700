"""Mixture-of-experts FFN: ``torch.ops.kiln.fused_moe``.

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` runs every token through its ``K`` chosen experts
and sums their outputs, each scaled by its routing weight::

    x             [T, H]        hidden states
    w13           [E, 2I, H]    each expert's gate and up projections, stacked (gate rows first)
    w2            [E, H, I]     each expert's down projection
    topk_weights  [T, K]        routing weights (any float dtype; the product is taken in it)
    topk_ids      [T, K]        expert of each (token, slot), int
    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),  e = topk_ids[t, k]

Routing (softmax, top-k, renormalization) stays in the model's graph, where Inductor fuses it;
only the expert computation is an opaque op, so a device kernel can sort tokens by expert and run
grouped GEMMs. The model always writes this generic op (the grouped pure-torch reference below);
``kiln.passes.moe_backend`` points it at the ``KernelSet``'s kernel (Triton on CUDA).

The reference loops over experts, not tokens: for each expert it gathers the rows routed to it
(``index_select``), runs its MLP as two matmuls and adds the weighted rows back (``index_add_``).
Its order of operations is transformers' (``MixtralExperts.forward``): the weighted product is
rounded to ``x``'s dtype before the sum. It finds each expert's rows with one host sync, so it is
not CUDA-graph safe; the Triton kernel is. Hence on CUDA tensors the generic op itself runs the
Triton kernel too (``kiln.ops.triton_moe`` registers it as the op's CUDA implementation when the
CUDA KernelSet is chosen), so eager and stock modes can capture CUDA graphs as well; everywhere
else it runs the reference.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kiln.ops.library import define_op

FusedMoEImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
GENERIC_MOE_OP = "kiln::fused_moe"


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """Grouped reference: one pass per expert that has tokens, no per-token Python loop."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1)  # [T * K], slot s belongs to token s // K
    order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # the one host sync
    flat_weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        rows = torch.div(slots, top_k, rounding_mode="floor")
        h = x.index_select(0, rows)  # [count, H]
        gate, up = F.linear(h, w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])  # [count, H]
        y = y * flat_weights.index_select(0, slots)[:, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def check_moe_shapes(x, w13, w2, topk_weights, topk_ids) -> None:
    num_experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"fused_moe: x {tuple(x.shape)} does not match w13 {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"fused_moe: w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} do not match x {tuple(x.shape)}")


def define_fused_moe_op(qualname: str, impl: FusedMoEImpl):
    """Define op ``qualname`` with the schema of ``kiln::fused_moe``, running ``impl``."""

    def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        return impl(x, w13, w2, topk_weights, topk_ids)

    return define_op(qualname, fused_moe, lambda x, w13, w2, topk_weights, topk_ids: torch.empty_like(x))


fused_moe = define_fused_moe_op(GENERIC_MOE_OP, fused_moe_reference)

