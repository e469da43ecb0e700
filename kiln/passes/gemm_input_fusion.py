"""``GemmInputFusionPass``: the op that feeds a GEMM joins it, as the KernelSet's joined kernels say.

Where the input of a GEMM op is the first output of an ``add_rms_norm`` (the residual add +
RMSNorm before q/k/v and gate/up) or the output of ``silu_and_mul`` (before down_proj), and the
GEMM is its only user, the pair becomes one op (``kiln.ops.joined_linear``)::

    before:  n = kiln_triton.add_rms_norm(x, res, w, eps);  h = n[0];  r = n[1]
             y = kiln_cuda.linear_dense(h, weight, bias)
    after:   f = kiln_cuda.add_rms_norm_linear_dense(x, res, w, eps, weight, bias)
             y = f[0];  r = f[1]

    before:  a = kiln_triton.silu_and_mul(gate_up);  y = kiln_cuda.linear_int4_triton(a, qw, sz, 32)
    after:   y = kiln_cuda.silu_and_mul_linear_int4(gate_up, qw, sz, 32)

The joined op takes the GEMM's arguments after its input (fp8: the weight, its scales and the
output dtype). Which GEMM ops join, and into which ops, is the ``KernelSet``'s
``joined_<scheme>`` (``kiln.ops.registry``): on CUDA the FP8 ops (which write quantized rows at
prefill row counts) and the dense ones, whose one-row GEMV computes its input from the feeding
op's inputs (one kernel a pair at batch-1 decode); FP8's and int4's one-row fed GEMVs with
``kernels.gemv_join=[dense,fp8,int4]``. Each
joined op picks its kernels by the row count it runs with, as the GEMMs do, so one dynamic build
serves decode and prefill.

Runs at ``post_grad``, after the add + RMSNorm and SiLU-and-mul fusions, on every piece. The
manager passes the joins whose kernels it enables; with none the pass changes nothing.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from kiln.ops.registry import JOINED_SCHEMES, JoinedLinearKernel, op_name, reference_joined
from kiln.passes.base import KilnPass

ADD_RMS_NORM = ("kiln::add_rms_norm", "kiln_triton::add_rms_norm")
SILU_AND_MUL = ("kiln::silu_and_mul", "kiln_triton::silu_and_mul")


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _call(graph: torch.fx.Graph, target: Any, args: tuple) -> torch.fx.Node:
    """A call node with its fake value, as Inductor's later passes expect of every node."""
    node = graph.call_function(target, args)
    vals = [_val(a) for a in args]
    if all(v is not None or a is None for v, a in zip(vals, args)):
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        if fake_mode is not None:
            with fake_mode:
                node.meta["val"] = target(*vals)
        elif target is operator.getitem:
            node.meta["val"] = vals[0][vals[1]]
    return node


def _schema_args(node: torch.fx.Node) -> Optional[list]:
    """The call's arguments in schema order, defaults filled in; None where one is missing."""
    target = node.target.default if isinstance(node.target, torch._ops.OpOverloadPacket) else node.target
    args = []
    for i, arg in enumerate(target._schema.arguments):
        if i < len(node.args):
            args.append(node.args[i])
        elif arg.name in node.kwargs:
            args.append(node.kwargs[arg.name])
        elif arg.has_default_value():
            args.append(arg.default_value)
        else:
            return None
    return args


def _joined_args(join: JoinedLinearKernel, gemm: torch.fx.Node) -> Optional[tuple]:
    """What the joined op takes after the feeding op's inputs: the GEMM's arguments after its input
    (fp8: the weight, its scales and the GEMM's output dtype)."""
    args = _schema_args(gemm)
    if args is None:
        return None
    if join.scheme == "fp8":
        out = _val(gemm)
        return None if out is None else (*args[1:3], out.dtype)
    return tuple(args[1:])


def _target(op: Any) -> Any:
    return getattr(op, "default", op)


class GemmInputFusionPass(KilnPass):
    stage = "post_grad"

    def __init__(self, joins: Optional[tuple[JoinedLinearKernel, ...]] = None) -> None:
        """``joins``: the joined kernels to write; by default the references of every scheme."""
        if joins is None:
            joins = tuple(reference_joined(s) for s in JOINED_SCHEMES)
        self.joins = tuple(joins)
        self._by_gemm = {name: j for j in self.joins for name in j.gemm_ops}

    def options(self) -> dict:
        return {"joins": [[j.scheme, list(j.gemm_ops), op_name(j.op), op_name(j.silu_op)] for j in self.joins]}

    def __call__(self, graph: torch.fx.Graph) -> int:
        count = 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            join = self._by_gemm.get(op_name(node.target) or "") if node.op == "call_function" else None
            if join is None or not node.args:
                continue
            a = node.args[0]
            if not isinstance(a, torch.fx.Node) or len(a.users) != 1:
                continue
            joined_args = _joined_args(join, node)
            if joined_args is None:
                continue
            if a.target is operator.getitem and a.args[1] == 0 and op_name(a.args[0].target) in ADD_RMS_NORM:
                if not self._join_norm(graph, order, join, node, a, joined_args):
                    continue
            elif op_name(a.target) in SILU_AND_MUL:
                with graph.inserting_before(node):
                    y = _call(graph, _target(join.silu_op), (*a.args, *joined_args))
                node.replace_all_uses_with(y)
                graph.erase_node(node)
                graph.erase_node(a)
            else:
                continue
            count += 1
        return count

    def _join_norm(self, graph: torch.fx.Graph, order: dict, join: JoinedLinearKernel, gemm: torch.fx.Node,
                   a: torch.fx.Node, joined_args: tuple) -> bool:
        norm = a.args[0]
        # The joined op replaces the norm where it stands (its residual may be used before the GEMM),
        # so the GEMM's weights must exist there: constants move up, else no fusion.
        late = [t for t in joined_args if isinstance(t, torch.fx.Node) and order[t] > order[norm]]
        if any(t.op != "get_attr" for t in late):
            return False
        for t in late:
            norm.prepend(t)
            order[t] = order[norm] - 0.5  # where it stands now, for the joins after this one
        with graph.inserting_before(norm):
            fused = _call(graph, _target(join.op), (*norm.args, *joined_args))
            y, residual = (_call(graph, operator.getitem, (fused, i)) for i in (0, 1))
        for user in list(norm.users):  # the new residual (item 1) now comes from the joined op
            if user is not a:
                user.replace_all_uses_with(residual)
                graph.erase_node(user)
        gemm.replace_all_uses_with(y)
        graph.erase_node(gemm)
        graph.erase_node(a)
        graph.erase_node(norm)
        return True
