"""``QuantLinearPass``: a linear on a dequantized weight -> the KernelSet's quantized GEMM op.

A quantized model (``kiln.models.quantize.QuantLinear``) writes, under compilation, a linear whose
weight is the output of a dequant op of its kernel (``QuantLinearKernel.dequant``): that marks the
weight as one the loader quantized. This pass finds each such linear, in any of the forms a graph
may hold it, and replaces it with the kernel op of that scheme, which reads the packed weight::

    before:  w = torch.ops.kiln_cpu.dequant_int4(qweight, scales_zeros, 32, torch.float32)
             y = torch._C._nn.linear(x, w, bias)          # or aten.linear / aten.mm(x, aten.t(w))
                                                          # or aten.addmm(bias, x, aten.t(w))
    after:   y = torch.ops.kiln_cpu.linear_int4(qweight, ...)(x, qweight, scales_zeros, 32) + bias
             (a kernel with an ``activation_dtype``, torch's CPU GEMMs: ``op(x.to(bfloat16), ...).type_as(x)``)

The scheme's kernel is the ``KernelSet``'s (``kiln.ops.registry``), found by the dequant op's name,
so the weight layout and the GEMM always agree. A dequant whose value is used elsewhere too stays
in place for those uses. Runs at ``dynamo`` stage, before the graph is split, so Inductor sees the
GEMM as one opaque op and never materializes the full weight; without the pass the graph still
computes the same product (dequantize, then a dense matmul).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F

from kiln.ops.registry import QUANT_SCHEMES, KernelSet, QuantLinearKernel, op_name, reference_kernels
from kiln.passes.base import KilnPass, fake_node, keep_source_meta

aten = torch.ops.aten
_LINEARS = (torch._C._nn.linear, F.linear, aten.linear.default)


def _is_transpose(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_method" and node.target in ("t",):
        return True
    if node.op != "call_function":
        return False
    if node.target in (aten.t.default, torch.t):
        return True
    if node.target is aten.permute.default and list(node.args[1]) in ([1, 0], [-1, -2]):
        return True
    return node.target in (aten.transpose.int, torch.transpose) and sorted(node.args[1:3]) in ([0, 1], [-2, -1])


def _activation_cast(kernel: QuantLinearKernel, scales: Any) -> Optional[torch.dtype]:
    """The dtype to cast the activations to around ``kernel``'s op: its ``activation_dtype`` when
    the weight's scales are in it (the kernel casts x to the scales' dtype), else None."""
    if kernel.activation_dtype is None or not isinstance(scales, torch.fx.Node):
        return None
    val = scales.meta.get("example_value", scales.meta.get("val"))
    return kernel.activation_dtype if getattr(val, "dtype", None) == kernel.activation_dtype else None


class QuantLinearPass(KilnPass):
    stage = "dynamo"

    def __init__(self, kernels: Optional[KernelSet] = None) -> None:
        self.kernels = kernels or reference_kernels()
        self._by_dequant: dict[str, QuantLinearKernel] = {}
        for scheme in QUANT_SCHEMES:
            chosen = self.kernels.quant_linear(scheme)
            reference = reference_kernels(self.kernels.device_type).quant_linear(scheme)
            for kernel in (reference, chosen):  # a layer the kernel cannot take keeps the reference layout
                self._by_dequant[kernel.dequant_name] = kernel

    def options(self) -> dict:
        # The activation dtype too: whether the graph casts around an op depends on the CPU it runs on.
        return {name: op_name(k.op) + (f" on {k.activation_dtype}" if k.activation_dtype else "")
                for name, k in sorted(self._by_dequant.items())}

    def _kernel_of(self, node: Any) -> Optional[QuantLinearKernel]:
        if isinstance(node, torch.fx.Node) and node.op == "call_function":
            return self._by_dequant.get(op_name(node.target) or "")
        return None

    def _match(self, node: torch.fx.Node) -> Optional[tuple[Any, torch.fx.Node, Any]]:
        """(x, dequant node, bias or None) when ``node`` is a linear on a dequantized weight."""
        if node.op != "call_function":
            return None
        if node.target in _LINEARS:
            x = node.args[0]
            w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            return (x, w, bias) if self._kernel_of(w) else None
        if node.target is aten.mm.default and _is_transpose(node.args[1]):
            w = node.args[1].args[0]
            return (node.args[0], w, None) if self._kernel_of(w) else None
        if node.target is aten.addmm.default and _is_transpose(node.args[2]) and not node.kwargs:
            w = node.args[2].args[0]
            return (node.args[1], w, node.args[0]) if self._kernel_of(w) else None
        return None

    def __call__(self, graph: torch.fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            found = self._match(node)
            if found is None:
                continue
            x, dequant, bias = found
            kernel = self._kernel_of(dequant)
            qweight, scales, group_size = dequant.args[:3]
            weight_users = [a for a in node.all_input_nodes if a is not x and a is not bias]
            cast = _activation_cast(kernel, scales)
            with graph.inserting_before(node):
                xc = x if cast is None else fake_node(graph, "call_method", "to", (x, cast))
                y = fake_node(graph, "call_function", kernel.op.default, (xc, qweight, scales, group_size))
                if cast is not None:  # back to x's dtype
                    y = fake_node(graph, "call_method", "type_as", (y, x))
                if bias is not None:
                    y = fake_node(graph, "call_function", operator.add, (y, bias))
            keep_source_meta(y, node)
            node.replace_all_uses_with(y)
            graph.erase_node(node)
            for orphan in dict.fromkeys((*weight_users, dequant)):  # the transpose, then the dequant, if unused
                if not orphan.users:
                    graph.erase_node(orphan)
            count += 1
        return count
