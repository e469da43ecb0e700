"""``LoraShrinkJoinPass``: the LoRA shrink joins the base linear's GEMM where A lies right after W.

``kiln.add_lora`` after a linear reads the linear's input a second time for its shrink (x @ A.T,
a kernel of its own) and keeps that input alive past the GEMM, so the add + RMSNorm or SiLU-and-mul
before it cannot join the GEMM (``GemmInputFusionPass`` needs the GEMM to be its only user). In the
joined layout (``kiln.models.lora``) the stack's A rows lie right after the weight's rows in one
buffer, so one GEMM over both computes the base output and every slot's h, and only the expand is
left (``kiln.expand_lora``)::

    before:  y = linear(x, W, None);  out = kiln.add_lora(y, x, A, B, sizes)
    after:   y_ext = linear(x, as_strided(W, [N + S * RR, K], [K, 1], W's offset), None)
             out = kiln.expand_lora(y_ext, B, sizes)

The adjacency is read from Dynamo's fake values (storage identity and offsets, as
``MergeSiblingLinearsPass`` reads it), so a linear laid out otherwise (a quantized or biased one, a
CPU model) keeps ``kiln.add_lora``. Runs at ``dynamo`` stage before ``LoraBackendPass`` (which
points both generic ops at the KernelSet's kernels) and ``DenseLinearPass`` (which turns the
joined linear into the set's GEMM); on where the set's LoRA kernel is ``fast`` (CUDA).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from kiln.ops.lora import GENERIC_LORA_OP
from kiln.ops.registry import op_name
from kiln.passes.base import KilnPass, fake_node, keep_source_meta, node_tensor

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


def _linear_without_bias(node: Any) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """(x, w) of a ``linear(x, w)`` call node with no bias; None for anything else."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _LINEARS:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, w, bias = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    if bias is not None or not isinstance(w, torch.fx.Node):
        return None
    return x, w


def _a_follows_w(w: torch.Tensor, a: torch.Tensor) -> bool:
    """A [S, RR, K] (contiguous) starts where W [N, K] (row-major) ends, in W's storage."""
    return (w.dim() == 2 and a.dim() == 3 and w.is_contiguous() and a.is_contiguous() and w.dtype == a.dtype
            and a.shape[2] == w.shape[1] and a.untyped_storage() is w.untyped_storage()
            and a.storage_offset() == w.storage_offset() + w.numel())


class LoraShrinkJoinPass(KilnPass):
    stage = "dynamo"

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def options(self) -> dict:
        return {"enabled": self.enabled}

    def __call__(self, graph: torch.fx.Graph) -> int:
        if not self.enabled:
            return 0
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or op_name(node.target) != GENERIC_LORA_OP or len(node.args) != 5:
                continue
            y, x, a, b, sizes = node.args
            linear = _linear_without_bias(y)
            if linear is None or linear[0] is not x or len(y.users) != 1:
                continue
            wv, av = node_tensor(linear[1]), node_tensor(a)
            if wv is None or av is None or not _a_follows_w(wv, av):
                continue
            self._join(graph, node, y, linear, a, b, sizes, wv, av)
            count += 1
        return count

    @staticmethod
    def _join(graph: torch.fx.Graph, node: torch.fx.Node, y: torch.fx.Node, linear: tuple, a: Any, b: Any,
              sizes: Any, wv: torch.Tensor, av: torch.Tensor) -> None:
        x, w = linear
        rows, k = wv.shape[0] + av.shape[0] * av.shape[1], wv.shape[1]
        call = functools.partial(fake_node, graph, "call_function")  # (target, args) -> node
        expand = torch.ops.kiln.expand_lora.default
        with graph.inserting_before(node):
            weight = call(torch.as_strided, (w, (rows, k), (k, 1), wv.storage_offset()))
            y_ext = call(y.target, (x, weight, None))  # [T, N + S * RR]: the base columns, then every slot's h
            out = call(expand, (y_ext, b, sizes))
        keep_source_meta(y_ext, y)
        keep_source_meta(out, node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        graph.erase_node(y)


__all__ = ["LoraShrinkJoinPass"]
