"""Greedy token choice: ``torch.ops.kiln.argmax``, each row's argmax of the logits.

A full decode graph (``kiln.compiler.cudagraph.FullCUDAGraphs``) ends with this op, so an all-greedy
batch reads back its tokens and launches nothing else. This module holds the schema, the fake impl
and the pure-torch reference (``logits.argmax(-1)``); a faster kernel (Triton on CUDA:
``kiln.ops.triton_argmax``) defines an op of the same schema with ``define_argmax_op``, and
``kiln.ops.registry`` chooses which one the graphs call.
"""

from __future__ import annotations

from typing import Callable

import torch

from kiln.ops.library import define_op

ArgmaxImpl = Callable[[torch.Tensor], torch.Tensor]


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] int64: the index of each row's first maximum."""
    return logits.argmax(dim=-1)


def define_argmax_op(qualname: str, impl: ArgmaxImpl):
    """Define op ``qualname`` with the schema of ``kiln::argmax``, running ``impl``."""

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return impl(logits)

    def fake(logits):
        return logits.new_empty(logits.shape[:-1], dtype=torch.int64)

    return define_op(qualname, argmax, fake)


argmax = define_argmax_op("kiln::argmax", argmax_reference)
