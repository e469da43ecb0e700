"""``Fp8QuantFusionPass``: the op that feeds an FP8 GEMM joins it, so the GEMM may take quantized rows.

An FP8 linear (``linear_fp8``, written by ``QuantLinearPass``) at prefill rows quantizes its input
per token before the GEMM: one more read and write of the activations. Where that input is the
first output of an ``add_rms_norm`` (the residual add + RMSNorm before q/k/v and gate/up) or the
output of ``silu_and_mul`` (before down_proj), and the GEMM is its only user, the pair becomes one
op::

    before:  n = kiln_triton.add_rms_norm(x, res, w, eps);  h = n[0];  r = n[1]
             y = kiln_cuda.linear_fp8(h, qweight, scales, -1)
    after:   f = kiln_triton.add_rms_norm_linear_fp8(x, res, w, eps, qweight, scales, bfloat16)
             y = f[0];  r = f[1]

    before:  a = kiln_triton.silu_and_mul(gate_up);  y = kiln_cuda.linear_fp8(a, qweight, scales, -1)
    after:   y = kiln_triton.silu_and_mul_linear_fp8(gate_up, qweight, scales, bfloat16)

The joined op chooses its kernels by the row count it runs with, as ``linear_fp8`` does (one
dynamic build serves decode and prefill): at prefill rows the norm / activation writes fp8 rows
and their scales and the GEMM reads them; at decode rows the GEMM is weight-only (W8A16) and needs
no quantized rows, so the plain norm / activation runs (``kiln.ops.triton_quant``).

Runs at ``post_grad``, after the add + RMSNorm and SiLU-and-mul fusions, on every piece. ``ops``
names the two joined ops (the Triton ones on CUDA, the ``kiln`` references in tests); the manager
enables the pass where the KernelSet's FP8 GEMM is a real kernel.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from kiln.ops.registry import op_name
from kiln.passes.base import KilnPass

LINEAR_FP8 = ("kiln::linear_fp8", "kiln_cuda::linear_fp8")
ADD_RMS_NORM = ("kiln::add_rms_norm", "kiln_triton::add_rms_norm")
SILU_AND_MUL = ("kiln::silu_and_mul", "kiln_triton::silu_and_mul")


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _call(graph: torch.fx.Graph, target: Any, args: tuple) -> torch.fx.Node:
    """A call node with its fake value, as Inductor's later passes expect of every node."""
    node = graph.call_function(target, args)
    vals = [_val(a) for a in args]
    if all(v is not None for v in vals):
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        if fake_mode is not None:
            with fake_mode:
                node.meta["val"] = target(*vals)
        elif target is operator.getitem:
            node.meta["val"] = vals[0][vals[1]]
    return node


class Fp8QuantFusionPass(KilnPass):
    stage = "post_grad"

    def __init__(self, enabled: bool = True, ops: Optional[tuple[Any, Any]] = None) -> None:
        self.enabled = enabled
        if ops is None:
            import kiln.ops.quant  # noqa: F401  (defines the reference ops)

            k = torch.ops.kiln
            ops = (k.add_rms_norm_linear_fp8, k.silu_and_mul_linear_fp8)
        self.norm_linear, self.silu_linear = (getattr(o, "default", o) for o in ops)

    def options(self) -> dict:
        if not self.enabled:
            return {"enabled": False}
        return {"enabled": True, "ops": [op_name(o) for o in (self.norm_linear, self.silu_linear)]}

    def __call__(self, graph: torch.fx.Graph) -> int:
        if not self.enabled:
            return 0
        count = 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            if node.op != "call_function" or op_name(node.target) not in LINEAR_FP8:
                continue
            a = node.args[0]
            if not isinstance(a, torch.fx.Node) or len(a.users) != 1:
                continue
            out_dtype = _val(node).dtype if _val(node) is not None else None
            if out_dtype is None:
                continue
            _, qweight, scales = node.args[:3]
            if a.target is operator.getitem and a.args[1] == 0 and op_name(a.args[0].target) in ADD_RMS_NORM:
                norm = a.args[0]
                # The joined op replaces the norm where it stands (its residual may be used before the
                # GEMM), so the weight and scales must exist there: constants move up, else no fusion.
                late = [t for t in (qweight, scales) if isinstance(t, torch.fx.Node) and order[t] > order[norm]]
                if any(t.op != "get_attr" for t in late):
                    continue
                for t in late:
                    norm.prepend(t)
                with graph.inserting_before(norm):
                    fused = _call(graph, self.norm_linear, (*norm.args, qweight, scales, out_dtype))
                    y, residual = (_call(graph, operator.getitem, (fused, i)) for i in (0, 1))
                for user in list(norm.users):  # the new residual (item 1) now comes from the joined op
                    if user is not a:
                        user.replace_all_uses_with(residual)
                        graph.erase_node(user)
                node.replace_all_uses_with(y)
                graph.erase_node(node)
                graph.erase_node(a)
                graph.erase_node(norm)
            elif op_name(a.target) in SILU_AND_MUL:
                with graph.inserting_before(node):
                    y = _call(graph, self.silu_linear, (*a.args, qweight, scales, out_dtype))
                node.replace_all_uses_with(y)
                graph.erase_node(node)
                graph.erase_node(a)
            else:
                continue
            count += 1
        return count
