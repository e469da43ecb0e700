"""``DenseLinearPass``: a linear on a bf16/fp16 weight of the KernelSet's device -> its dense GEMM op.

Inductor hands a dense linear to cuBLAS (an extern ``mm``), whose one-row tiles leave bandwidth
unused at batch-1 decode. The KernelSet's ``linear_dense`` op (``kiln.ops.dense_linear``) runs
kiln's Triton GEMV at one row and ``F.linear`` at any other row count, so this pass swaps it in
for every dense linear of a 16-bit weight on the set's device::

    before:  y = torch._C._nn.linear(x, w, bias)           # w: a bf16 parameter on cuda
    after:   y = torch.ops.kiln_cuda.linear_dense(x, w, bias)

Runs at ``dynamo`` stage, after ``QuantLinearPass`` (a quantized linear is already its scheme's
op) and ``MergeSiblingLinearsPass`` (a merged qkv is one linear here). Off where the set's op is
the reference (``F.linear`` itself: nothing to gain), or where ``PassConfig.fusion`` is off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.dense_linear import GEMV_DTYPES
from kiln.ops.registry import op_name
from kiln.passes.base import KilnPass, node_tensor

_LINEARS = (torch._C._nn.linear, F.linear, torch.ops.aten.linear.default)


class DenseLinearPass(KilnPass):
    stage = "dynamo"

    def __init__(self, enabled: bool, op: Any, device_type: str) -> None:
        self.enabled = enabled
        self.op = op
        self.device_type = device_type

    def options(self) -> dict:
        return {"enabled": self.enabled, "op": op_name(self.op), "device_type": self.device_type}

    def _takes(self, x: Any, w: Any) -> bool:
        xv, wv = node_tensor(x), node_tensor(w)
        return (xv is not None and wv is not None and wv.dim() == 2 and wv.device.type == self.device_type
                and wv.dtype in GEMV_DTYPES and xv.dtype == wv.dtype)

    def __call__(self, graph: torch.fx.Graph) -> int:
        if not self.enabled:
            return 0
        target = self.op.default if isinstance(self.op, torch._ops.OpOverloadPacket) else self.op
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _LINEARS:
                continue
            args = list(node.args) + [None] * (3 - len(node.args))
            x, w, bias = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
            if not self._takes(x, w):
                continue
            with graph.inserting_before(node):
                gemm = graph.call_function(target, (x, w, bias))
            gemm.meta.update(node.meta)
            node.replace_all_uses_with(gemm)
            graph.erase_node(node)
            count += 1
        return count
