"""Collectives as kiln custom ops: ``torch.ops.kiln.all_reduce(x) -> Tensor``.

Why an op and not a bare ``torch.distributed.all_reduce`` call in the model: Dynamo breaks the
graph at in-place process-group calls, and kiln compiles one graph split only at attention. As a
functional custom op with a fake impl, the all-reduce is one ordinary node that Inductor leaves
as a fallback call, so a tensor-parallel layer stays inside its piece.

Rules kept here:
- Functional: the input is never mutated; the op returns a new tensor (the sum over ranks).
- It reduces over the default process group, which the executor's worker initializes once per
  rank (gloo on CPU, NCCL on CUDA) before the model is built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over every rank of the default group; same shape and dtype as ``x``."""
    out = x.clone()
    dist.all_reduce(out)
    return out


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def all_reduce_reference(shards: list[torch.Tensor]) -> torch.Tensor:
    """What every rank holds after the op, given each rank's input (for tests)."""
    return torch.stack(shards).sum(0).to(shards[0].dtype)
