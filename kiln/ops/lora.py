"""Batched LoRA: ``torch.ops.kiln.add_lora``, one linear's adapters for every token of a step.

Each targeted linear holds the adapters of every device slot stacked (``kiln.models.lora``), and
each token of the step names its slot in the forward context (``ForwardContext.lora_slots``: 0 is
the base model, k the stack's row k - 1). The op adds, token by token,
``y[t] += (x[t] @ A[s].T) @ B[s]`` with s = slot(t) - 1, the adapter's scaling folded into B::

    x [T, in] ── shrink by slot: A [S, R, in] ──> h [T, R] ── expand by slot: B [S, R, out] ──> + y [T, out]

(punica's BGMV/SGMV in one op). A fused linear (qkv, gate_up) holds its slices block-diagonally:
``slice_sizes`` are its output slices (q, k, v), each with R = ranks / len(slice_sizes) rank rows,
and slice j's output columns take only rank rows j*R..(j+1)*R (the rest of B is never read)::

    lora_b[s]   cols:  q           k       v
      rows 0..R       [B_q         .       .  ]
      rows R..2R      [.           B_k     .  ]
      rows 2R..3R     [.           .       B_v]

The slots are data, never a graph constant: changing which adapter a token uses, or which
adapter a slot holds (written in place), recompiles nothing, and a CUDA graph captured once
replays any mix. A linear whose slots are all zero (a base-model token) gets
``y`` back exactly (its A and B rows are never read).

``torch.ops.kiln.expand_lora`` is the same term when the base linear computed the shrink itself:
where the stack's A rows lie right after the linear's weight rows in one buffer (``LoraStack``'s
joined layout on CUDA), ``LoraShrinkJoinPass`` runs the linear over both, and the op takes its
output, the base columns then every slot's h::

    y_ext [T, out + S * slices * R] = x @ [W; A[0]; ...; A[S-1]].T
    expand_lora(y_ext, B, slice_sizes) = y_ext[:, :out] + each token's h (its slot's columns) @ B[s]

The reference computes every slot's shrink at once and keeps each token's own (a mask, no host
sync, so it is capturable), then one expand GEMM per slice over its masked ranks. The Triton kernels
(``kiln.ops.triton_lora``) are checked against it; ``kiln.ops.registry`` picks the kernel and
``LoraBackendPass`` points the graph at it.
"""

from __future__ import annotations

from typing import Callable

import torch

from kiln.forward_context import get_forward_context
from kiln.ops.library import define_op

GENERIC_LORA_OP = "kiln::add_lora"
GENERIC_EXPAND_LORA_OP = "kiln::expand_lora"

LoraImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], torch.Tensor], torch.Tensor]
ExpandLoraImpl = Callable[[torch.Tensor, torch.Tensor, list[int], torch.Tensor], torch.Tensor]


def slice_rank(lora_a: torch.Tensor, lora_b: torch.Tensor, slice_sizes: list[int]) -> int:
    """Rank rows per slice (R); ValueError if the stack's shapes do not fit ``slice_sizes``."""
    ranks = lora_a.shape[1]
    if not slice_sizes or ranks % len(slice_sizes) or sum(slice_sizes) != lora_b.shape[2] or lora_b.shape[1] != ranks:
        raise ValueError(f"kiln.add_lora: lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} do not fit "
                         f"slice_sizes {list(slice_sizes)} (B's columns are the slices, R rank rows each)")
    return ranks // len(slice_sizes)


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       slice_sizes: list[int], token_slots: torch.Tensor) -> torch.Tensor:
    """y: [T, out], x: [T, in], lora_a: [S, slices * R, in], lora_b: [S, slices * R, out],
    slice_sizes: the slices' output sizes (sum: out), token_slots: [>= T] int (0: no adapter,
    k: stack row k - 1) -> y + each token's LoRA term, [T, out] in y's dtype."""
    num_slots, ranks, _ = lora_a.shape
    slice_rank(lora_a, lora_b, slice_sizes)
    h = (x.to(lora_a.dtype) @ lora_a.reshape(num_slots * ranks, -1).T).view(x.shape[0], num_slots, ranks)
    return _expand_reference(y, h, lora_b, slice_sizes, token_slots)


def expand_lora_reference(y_ext: torch.Tensor, lora_b: torch.Tensor, slice_sizes: list[int],
                          token_slots: torch.Tensor) -> torch.Tensor:
    """y_ext: [T, out + S * slices * R] (the base linear's output, then each slot's shrink h),
    lora_b: [S, slices * R, out] -> y_ext's base columns + each token's LoRA term, [T, out]."""
    num_slots, ranks, out_features = lora_b.shape
    if len(slice_sizes) == 0 or sum(slice_sizes) != out_features or ranks % len(slice_sizes) \
            or y_ext.shape[1] != out_features + num_slots * ranks:
        raise ValueError(f"kiln.expand_lora: y_ext {tuple(y_ext.shape)} and lora_b {tuple(lora_b.shape)} do not fit "
                         f"slice_sizes {list(slice_sizes)} (y_ext's columns: out, then S * slices * R)")
    h = y_ext[:, out_features:].to(lora_b.dtype).view(y_ext.shape[0], num_slots, ranks)
    return _expand_reference(y_ext[:, :out_features], h, lora_b, slice_sizes, token_slots)


def _expand_reference(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, slice_sizes: list[int],
                      token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, out] + each token's own slot's h [T, S, slices * R] expanded by slice."""
    num_tokens, num_slots, ranks = h.shape
    rank = ranks // len(slice_sizes)
    slots = token_slots[:num_tokens].long()
    mine = slots.unsqueeze(1) == torch.arange(1, num_slots + 1, device=h.device)  # [T, S]
    h = torch.where(mine.unsqueeze(-1), h, 0.0)  # [T, S, slices * R]
    deltas, col = [], 0
    for j, size in enumerate(slice_sizes):
        rows = slice(j * rank, (j + 1) * rank)
        h_j = h[:, :, rows].reshape(num_tokens, num_slots * rank)  # [T, S * R]
        deltas.append(h_j @ lora_b[:, rows, col:col + size].reshape(num_slots * rank, size))  # [T, size]
        col += size
    return y + torch.cat(deltas, dim=1).to(y.dtype)  # [T, out]


def define_add_lora_op(qualname: str, impl: LoraImpl):
    """Define op ``qualname`` with the schema of ``kiln::add_lora``, running ``impl`` on the step's
    token slots (the forward context's; none: every token is the base model's)."""

    def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 slice_sizes: list[int]) -> torch.Tensor:
        slots = get_forward_context().lora_slots
        if slots is None:
            return y.clone()  # outputs never alias inputs (kiln.ops.library)
        return impl(y, x, lora_a, lora_b, slice_sizes, slots)

    def fake(y, x, lora_a, lora_b, slice_sizes):
        return torch.empty_like(y)

    return define_op(qualname, add_lora, fake)


add_lora = define_add_lora_op(GENERIC_LORA_OP, add_lora_reference)


def define_expand_lora_op(qualname: str, impl: ExpandLoraImpl):
    """Define op ``qualname`` with the schema of ``kiln::expand_lora``, running ``impl`` on the
    step's token slots (none: every token is the base model's, y_ext's base columns come back)."""

    def expand_lora(y_ext: torch.Tensor, lora_b: torch.Tensor, slice_sizes: list[int]) -> torch.Tensor:
        slots = get_forward_context().lora_slots
        if slots is None:
            return y_ext[:, :lora_b.shape[2]].clone(memory_format=torch.contiguous_format)
        return impl(y_ext, lora_b, slice_sizes, slots)

    def fake(y_ext, lora_b, slice_sizes):
        return y_ext.new_empty((y_ext.shape[0], lora_b.shape[2]))

    return define_op(qualname, expand_lora, fake)


expand_lora = define_expand_lora_op(GENERIC_EXPAND_LORA_OP, expand_lora_reference)
