"""``LoraBackendPass``: point each generic ``kiln.add_lora`` call at the KernelSet's LoRA kernel.

A model served with adapters (``lora.max_loras``) adds one ``kiln.add_lora`` after each targeted
linear (``kiln.models.lora.LoraStack``); its adapter weights are buffers of the model (graph
inputs, written in place when a slot changes adapter) and the token slots come from the forward
context, so the graph is captured once for every mix of adapters. On CUDA the set's kernel is the
Triton shrink/expand pair (``kiln.ops.triton_lora``)::

    before:  qkv = linear(x, w_qkv);  qkv2 = torch.ops.kiln.add_lora(qkv, x, lora_a, lora_b, [q, kv, kv])
    after:   qkv = linear(x, w_qkv);  qkv2 = torch.ops.kiln_triton.add_lora(qkv, x, lora_a, lora_b, [q, kv, kv])

and a ``kiln.expand_lora`` (``LoraShrinkJoinPass``'s, before this pass) at the set's expand op.

Runs at ``dynamo`` stage, like the MoE swap; a model without adapters has no call to move.
"""

from __future__ import annotations

import torch

from kiln.ops.lora import GENERIC_EXPAND_LORA_OP, GENERIC_LORA_OP
from kiln.ops.registry import KernelSet, reference_kernels
from kiln.passes.base import KilnPass, retarget


class LoraBackendPass(KilnPass):
    stage = "dynamo"

    def __init__(self, kernels: KernelSet | None = None) -> None:
        self.kernels = kernels or reference_kernels()

    def options(self) -> dict:
        return {"device_type": self.kernels.device_type, "kernel": self.kernels.lora.op_name,
                "expand_kernel": self.kernels.lora.expand_op_name}

    def __call__(self, graph: torch.fx.Graph) -> int:
        lora = self.kernels.lora
        return retarget(graph, GENERIC_LORA_OP, lora.op) + retarget(graph, GENERIC_EXPAND_LORA_OP, lora.expand_op)
