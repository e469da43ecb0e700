"""``HeadsViewPass``: view a projection's heads before taking columns of it, not after.

A fused projection (q/k/v of one GEMM, merged by the model or by ``MergeSiblingLinearsPass``) is
split by columns and each part viewed as heads. The view of a row-strided part makes Inductor
compute its strides while lowering it, which guards ``num_tokens != 1`` (the size-1 case has
other strides), and kiln then gives every piece a second, static build for one token
(``kiln.compiler.backend.sizes_excluded_by_guards``): Qwen3, Gemma 3, OLMo-2 and the generic
transformers path built each piece twice. Viewing the whole contiguous projection as heads, then
slicing heads, gives the same tensor (values and strides) with no guard::

    before:  parts = aten.split_with_sizes(qkv, [q, kv, kv], -1)      qkv: [T, N] contiguous
             q = aten.reshape(parts[0], [-1, H, D])                  [T, H, D], strides (N, D, 1)
    after:   heads = aten.view(qkv, [-1, N / D, D])
             q = aten.slice(heads, 1, 0, H)                          [T, H, D], strides (N, D, 1)

Rewritten: ``view`` / ``reshape`` / ``_unsafe_view`` into ``[..., h, D]`` of columns ``[a, a + h D)``
(a ``split``, ``split_with_sizes`` or step-1 ``slice`` of the last dim) of a contiguous ``[..., N]``
tensor (``[T, N]``, or transformers' ``[1, T, N]``), the leading sizes kept, where D divides a and
N. One heads view per tensor and head size.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from kiln.passes.base import KilnPass, fake_node, keep_source_meta, node_tensor

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)


def _int(v: object) -> Optional[int]:
    """v as an int where it is one (a plain int, or a symbolic size fixed to a value)."""
    return int(v) if is_concrete_int(v) else None


def _is_rows(x: Optional[torch.Tensor]) -> bool:
    """A contiguous [..., N] tensor with N known and at most one leading size unknown."""
    if x is None or x.dim() < 2 or _int(x.shape[-1]) is None:
        return False
    if sum(_int(s) is None for s in x.shape[:-1]) > 1:
        return False
    expected = 1
    for size, stride in zip(reversed(x.shape), reversed(x.stride())):
        if not (statically_known_true(size == 1) or statically_known_true(stride == expected)):
            return False
        expected = expected * size
    return True


def _last_dim(dim: object, x: torch.fx.Node) -> bool:
    return dim in (-1, node_tensor(x).dim() - 1)


def _columns(node: object) -> Optional[tuple[torch.fx.Node, int, int]]:
    """(x, first column, number of columns) when ``node`` is a step-1 range of x's last dim."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is operator.getitem:
        split, index = node.args
        if not (isinstance(split, torch.fx.Node) and split.op == "call_function" and split.target in _SPLITS):
            return None
        x, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if not _is_rows(node_tensor(x)) or not _last_dim(dim, x):
            return None
        n = _int(node_tensor(x).shape[-1])
        sizes = [_int(sizes)] if not isinstance(sizes, (list, tuple)) else [_int(s) for s in sizes]
        if None in sizes:
            return None
        if len(sizes) == 1:  # aten.split: parts of this size, the last one shorter
            sizes = [min(sizes[0], n - start) for start in range(0, n, sizes[0])]
        return x, sum(sizes[:index]), sizes[index]
    if node.target is aten.slice.Tensor:
        x, dim, start, end, step = (*node.args, *[None] * (5 - len(node.args)))[:5]
        if step not in (None, 1) or not _is_rows(node_tensor(x)) or not _last_dim(dim, x):
            return None
        n = _int(node_tensor(x).shape[-1])
        start, end = _int(0 if start is None else start), _int(n if end is None else end)
        if start is None or end is None:
            return None
        start, end = max(0, start + n if start < 0 else start), min(n, end + n if end < 0 else end)
        return x, start, max(0, end - start)
    return None


class HeadsViewPass(KilnPass):
    stage = "post_grad"

    def __call__(self, graph: torch.fx.Graph) -> int:
        heads: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _VIEWS:
                continue
            cols = _columns(node.args[0])
            out = node_tensor(node)
            if cols is None or out is None:
                continue
            x, start, length = cols
            xv = node_tensor(x)
            if out.dim() != xv.dim() + 1:
                continue
            n, h, d = _int(xv.shape[-1]), _int(out.shape[-2]), _int(out.shape[-1])
            if h is None or d is None or h * d != length or start % d or n % d:
                continue
            if not all(statically_known_true(a == b) for a, b in zip(out.shape[:-2], xv.shape[:-1])):
                continue
            with graph.inserting_before(node):
                if (x, d) not in heads:  # before its first use, after x: x is defined above node
                    lead = [-1 if _int(s) is None else _int(s) for s in xv.shape[:-1]]
                    heads[x, d] = fake_node(graph, "call_function", aten.view.default, (x, [*lead, n // d, d]))
                new = fake_node(graph, "call_function", aten.slice.Tensor,
                                (heads[x, d], xv.dim() - 1, start // d, start // d + h))
            keep_source_meta(new, node)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            count += 1
        if count:
            graph.eliminate_dead_code()  # splits whose parts were all viewed
        return count
