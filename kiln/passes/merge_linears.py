"""``MergeSiblingLinearsPass``: linears that read the same input and whose weights lie end to end
in one buffer become one GEMM.

transformers' modeling code projects q, k and v (and an MLP's gate and up) with separate
``nn.Linear`` layers on the same hidden state: three GEMMs where one would do, each a separate
kernel a decode step waits for. The generic path lays such weights end to end in one buffer when it
builds the model (``kiln.models.hf_generic.lay_out_sibling_linears``); this pass, on the graph
Dynamo captured, finds linears of one input whose weights (and biases) are adjacent rows of one
storage, starting at its first element, and replaces them with one linear over a view of the whole
run, split back into the original outputs:

    before:  q = linear(x, Wq, bq);  k = linear(x, Wk, bk);  v = linear(x, Wv, bv)
    after:   qkv = linear(x, as_strided(Wq, [Nq+Nk+Nv, K], [K, 1], 0), as_strided(bq, ...))
             q, k, v = split(qkv, [Nq, Nk, Nv], -1)

The view reads memory the weights already occupy: nothing is copied, per step or at start. The
adjacency is read from Dynamo's fake values (which keep storage identity and offsets), so a model
whose weights are laid out otherwise (the native path, quantized layers) is left as it is. kiln's
CPU decode linears (``kiln_cpu::linear_f32`` / ``linear_bf16``) merge the same way, into their op.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Optional

import torch

from kiln.passes.base import KilnPass, fake_node, keep_source_meta, node_tensor

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
# kiln's CPU decode linears (kiln.ops.cpu_linear.CPU_LINEAR_OPS): F.linear's signature and result.
_KILN_LINEARS = ("kiln_cpu::linear_bf16", "kiln_cpu::linear_f32")


def _is_linear(target: Any) -> bool:
    if target in _LINEARS:
        return True
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name in _KILN_LINEARS
    return isinstance(target, torch._ops.OpOverload) and target._schema.name in _KILN_LINEARS


def _linear_args(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, Optional[torch.fx.Node]]]:
    if node.op != "call_function" or not _is_linear(node.target):
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, w, b = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    if not isinstance(x, torch.fx.Node) or not isinstance(w, torch.fx.Node):
        return None
    return x, w, b if isinstance(b, torch.fx.Node) else None


def _row_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1]


def _adjacent(parts: list[torch.Tensor], row: int) -> bool:
    """``parts`` lie end to end in one storage, the first at its start (``row`` elements per row)."""
    storage = parts[0].untyped_storage()
    offset = 0
    for t in parts:
        if t.untyped_storage() is not storage or t.storage_offset() != offset or not t.is_contiguous():
            return False
        offset += t.shape[0] * row
    return True


class MergeSiblingLinearsPass(KilnPass):
    stage = "dynamo"

    def __call__(self, graph: torch.fx.Graph) -> int:
        by_input: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            a = _linear_args(node)
            if a is not None:
                by_input.setdefault(a[0], []).append(node)
        merged = 0
        for group in by_input.values():
            if len(group) > 1:
                merged += self._merge_runs(graph, group)
        return merged

    def _merge_runs(self, graph: torch.fx.Graph, group: list[torch.fx.Node]) -> int:
        """Merge the runs of ``group`` (linears of one input) whose weights are adjacent."""
        entries = []
        for node in group:
            _, w, b = _linear_args(node)
            wv, bv = node_tensor(w), node_tensor(b) if b is not None else None
            if wv is None or not _row_major(wv) or (b is not None and (bv is None or bv.dim() != 1)):
                continue
            entries.append((node, w, b, wv, bv))
        # Order by position in storage; a run starts at offset 0 of a storage.
        entries.sort(key=lambda e: (id(e[3].untyped_storage()), e[3].storage_offset()))
        count, i = 0, 0
        while i < len(entries):
            j = i + 1
            while j < len(entries) and self._extends(entries[i:j + 1]):
                j += 1
            if j - i > 1:
                self._merge(graph, entries[i:j])
                count += j - i
            i = j
        return count

    @staticmethod
    def _extends(run: list[tuple]) -> bool:
        ws = [e[3] for e in run]
        if len({e[0].target in _LINEARS or str(e[0].target) for e in run}) > 1:  # one op for the run
            return False
        k = ws[0].shape[1]
        if any(w.shape[1] != k or w.dtype != ws[0].dtype for w in ws) or not _adjacent(ws, k):
            return False
        biases = [e[4] for e in run]
        if all(b is None for b in biases):
            return True
        return all(b is not None and b.dtype == biases[0].dtype for b in biases) and _adjacent(biases, 1)

    @staticmethod
    def _merge(graph: torch.fx.Graph, run: list[tuple]) -> None:
        nodes = [e[0] for e in run]
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(nodes, key=order.__getitem__)
        x = _linear_args(first)[0]
        sizes = [e[3].shape[0] for e in run]
        total, k = sum(sizes), run[0][3].shape[1]
        w0, b0 = run[0][1], run[0][2]
        call = functools.partial(fake_node, graph, "call_function")  # (target, args) -> node

        with graph.inserting_before(first):
            weight = call(torch.as_strided, (w0, (total, k), (k, 1), 0))
            bias = call(torch.as_strided, (b0, (total,), (1,), 0)) if b0 is not None else None
            out = call(first.target, (x, weight, bias))  # the same linear, over the whole run
            parts = call(torch.split, (out, sizes, -1))
            pieces = [call(operator.getitem, (parts, i)) for i in range(len(run))]
        for node, piece in zip(nodes, pieces):
            keep_source_meta(piece, node)
            node.replace_all_uses_with(piece)
            graph.erase_node(node)


__all__ = ["MergeSiblingLinearsPass"]
