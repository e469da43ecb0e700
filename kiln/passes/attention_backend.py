"""``AttentionBackendPass``: point each generic ``kiln.attend_paged`` call at the KernelSet's kernel op.

Runs at ``dynamo`` stage, on the captured graph before it is split: the attention op is the split
point, so it never enters a piece and Inductor's passes never see it.

The kernel comes from the ``KernelSet`` the compiled model was built with (``kiln.ops.registry``:
Triton on CUDA, ``csrc/`` C++ on CPU when built), and the pass rewrites the call target::

    before:  o = torch.ops.kiln.attend_paged(q, k, v, 3, 0.125)
    after:   o = torch.ops.kiln_cpu.attend_paged(q, k, v, 3, 0.125)

When the set's attention kernel is the generic op itself (the reference) the graph is left alone.
The graph split (``kiln.compiler.split``) cuts at ``KernelSet.split_op_names()``, the generic op
and this kernel op, so a swapped call still splits the graph.
"""

from __future__ import annotations

import torch

from kiln.ops.registry import GENERIC_ATTENTION_OP, KernelSet, reference_kernels
from kiln.passes.base import KilnPass, retarget


class AttentionBackendPass(KilnPass):
    stage = "dynamo"

    def __init__(self, kernels: KernelSet | None = None) -> None:
        self.kernels = kernels or reference_kernels()

    def options(self) -> dict:
        return {"device_type": self.kernels.device_type, "kernel": self.kernels.attention.op_name}

    def __call__(self, graph: torch.fx.Graph) -> int:
        return retarget(graph, GENERIC_ATTENTION_OP, self.kernels.attention.op)
