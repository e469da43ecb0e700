"""``MoEBackendPass``: point each generic ``kiln.fused_moe`` call at the KernelSet's MoE kernel.

The model writes the generic op (``kiln.ops.moe``: the grouped pure-torch reference); on CUDA the
set's kernel is the Triton fused MoE (``kiln.ops.triton_moe``), which sorts tokens by expert and
runs grouped GEMMs without host syncs, so the rewritten graph can be captured into CUDA graphs::

    before:  y = torch.ops.kiln.fused_moe(x, w13, w2, topk_weights, topk_ids)
    after:   y = torch.ops.kiln_triton.fused_moe(x, w13, w2, topk_weights, topk_ids)

Runs at ``dynamo`` stage, like the attention swap: the op is opaque to Inductor either way, and a
dense model's graph has no call to move.
"""

from __future__ import annotations

import torch

from kiln.ops.moe import GENERIC_MOE_OP
from kiln.ops.registry import KernelSet, reference_kernels
from kiln.passes.base import KilnPass, retarget


class MoEBackendPass(KilnPass):
    stage = "dynamo"

    def __init__(self, kernels: KernelSet | None = None) -> None:
        self.kernels = kernels or reference_kernels()

    def options(self) -> dict:
        return {"device_type": self.kernels.device_type, "kernel": self.kernels.moe.op_name}

    def __call__(self, graph: torch.fx.Graph) -> int:
        return retarget(graph, GENERIC_MOE_OP, self.kernels.moe.op)
