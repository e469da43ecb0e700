"""Collectives as kiln custom ops: ``torch.ops.kiln.all_reduce(x) -> Tensor`` (row-parallel
outputs, the vocab-parallel embedding) and ``torch.ops.kiln.all_gather(x) -> Tensor``
(vocab-parallel logits).

Why ops and not bare ``torch.distributed`` calls in the model: Dynamo breaks the
graph at in-place process-group calls, and kiln compiles one graph split only at attention. As a
functional custom op with a fake impl, the all-reduce is one ordinary node that Inductor leaves
as a fallback call, so a tensor-parallel layer stays inside its piece.

Rules kept here:
- Functional: the input is never mutated; each op returns a new tensor (the sum over ranks, or
  every rank's tensor concatenated along the last dim in rank order).
- Every rank calls every collective, in the same order, or the group deadlocks.
- They run over the tensor-parallel group: the default process group, which the executor's worker
  initializes once per rank (gloo on CPU, NCCL on CUDA) before the model is built, or under
  pipeline parallelism the stage's own group, which the worker names once with
  ``set_tensor_parallel_group`` (the other stages' ranks never join a stage's collectives).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from kiln.ops import symm_mem_all_reduce
from kiln.ops.library import define_op

# torch >= 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_tp_group: Optional[dist.ProcessGroup] = None  # None: the default group


def set_tensor_parallel_group(group: Optional[dist.ProcessGroup]) -> None:
    """The group the collectives below run over in this process (None: the default group)."""
    global _tp_group
    _tp_group = group


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over every rank of the default group; same shape and dtype as ``x``."""
    fast = symm_mem_all_reduce.active()  # parallel.all_reduce=symm_mem, set up by the worker
    if fast is not None and fast.accepts(x):
        return fast(x)
    out = x.clone()
    dist.all_reduce(out, group=_tp_group)
    return out


def _all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


all_reduce = define_op("kiln::all_reduce", _all_reduce, _all_reduce_fake)


def all_reduce_reference(shards: list[torch.Tensor]) -> torch.Tensor:
    """What every rank holds after the op, given each rank's input (for tests)."""
    return torch.stack(shards).sum(0).to(shards[0].dtype)


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dim in rank order: [..., n] -> [..., size * n]."""
    size = dist.get_world_size(_tp_group)
    flat = x.new_empty(size * x.numel())  # rank-major: every backend gathers along dim 0
    _all_gather_flat(flat, x.contiguous().view(-1), group=_tp_group)
    # [size, ..., n] -> [..., size, n] -> [..., size * n]
    return flat.view(size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def _all_gather_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], dist.get_world_size(_tp_group) * x.shape[-1]))


all_gather = define_op("kiln::all_gather", _all_gather, _all_gather_fake)


def all_gather_reference(shards: list[torch.Tensor]) -> torch.Tensor:
    """What every rank holds after ``all_gather``, given each rank's input (for tests)."""
    return torch.cat(shards, dim=-1)
