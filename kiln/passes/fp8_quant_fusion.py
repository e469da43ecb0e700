"""``Fp8QuantFusionPass``: the op that feeds an FP8 GEMM also quantizes its rows.

An FP8 linear (``linear_fp8``, written by ``QuantLinearPass``) quantizes its input per token before
the GEMM: one more read and write of the activations. Where that input is the first output of an
``add_rms_norm`` (the residual add + RMSNorm before q/k/v and gate/up) or the output of
``silu_and_mul`` (before down_proj), and the GEMM is its only user, both become one op that writes
fp8 rows and their scales, and the GEMM takes them as they are::

    before:  n = kiln_triton.add_rms_norm(x, res, w, eps);  h = n[0];  r = n[1]
             y = kiln_cuda.linear_fp8(h, qweight, scales, -1)
    after:   f = kiln_triton.add_rms_norm_quant_fp8(x, res, w, eps);  r = f[2]
             y = kiln_triton.linear_fp8_prequant(f[0], f[1], qweight, scales, bfloat16)

    before:  a = kiln_triton.silu_and_mul(gate_up);  y = kiln_cuda.linear_fp8(a, qweight, scales, -1)
    after:   f = kiln_triton.silu_and_mul_quant_fp8(gate_up)
             y = kiln_triton.linear_fp8_prequant(f[0], f[1], qweight, scales, bfloat16)

Runs at ``post_grad``, after the add + RMSNorm and SiLU-and-mul fusions, on every piece. ``ops``
names the three fused ops (the Triton ones on CUDA, the ``kiln`` references in tests); the manager
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

    def __init__(self, enabled: bool = True, ops: Optional[tuple[Any, Any, Any]] = None) -> None:
        self.enabled = enabled
        if ops is None:
            import kiln.ops.quant  # noqa: F401  (defines the reference ops)

            k = torch.ops.kiln
            ops = (k.add_rms_norm_quant_fp8, k.silu_and_mul_quant_fp8, k.linear_fp8_prequant)
        self.norm_quant, self.silu_quant, self.gemm = (getattr(o, "default", o) for o in ops)

    def options(self) -> dict:
        if not self.enabled:
            return {"enabled": False}
        return {"enabled": True, "ops": [op_name(o) for o in (self.norm_quant, self.silu_quant, self.gemm)]}

    def __call__(self, graph: torch.fx.Graph) -> int:
        if not self.enabled:
            return 0
        count = 0
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
                with graph.inserting_before(norm):
                    fused = _call(graph, self.norm_quant, tuple(norm.args))
                    xq, xs = (_call(graph, operator.getitem, (fused, i)) for i in (0, 1))
                    residual = _call(graph, operator.getitem, (fused, 2))
                for user in list(norm.users):  # the new residual (item 1) now comes from the fused op
                    if user is not a:
                        user.replace_all_uses_with(residual)
                        graph.erase_node(user)
            elif op_name(a.target) in SILU_AND_MUL:
                with graph.inserting_before(a):
                    fused = _call(graph, self.silu_quant, tuple(a.args))
                    xq, xs = (_call(graph, operator.getitem, (fused, i)) for i in (0, 1))
            else:
                continue
            with graph.inserting_before(node):
                y = _call(graph, self.gemm, (xq, xs, qweight, scales, out_dtype))
            node.replace_all_uses_with(y)
            graph.erase_node(node)
            graph.erase_node(a)
            if a.target is operator.getitem and not norm.users:
                graph.erase_node(norm)
            count += 1
        return count
