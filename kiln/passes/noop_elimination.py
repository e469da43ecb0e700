"""``NoOpEliminationPass``: drop views, slices and casts that return their input unchanged.

Runs at ``post_grad`` (aten level) because that is where such no-ops exist: Dynamo-level ones like
``x.float()`` on a float32 tensor vanish in tracing, while decomposition leaves reshapes and slices
whose output shape equals the input shape (e.g. a ``reshape(x, [s0, 64])`` of an ``[s0, 64]``
tensor). Shapes are compared with ``statically_known_true``, which never adds a guard: a
reshape whose equality depends on the value of ``num_tokens`` is kept.

    before:  view = aten.reshape(x, [s0, 64]);  sl = aten.slice(view, 1, 0, 9223372036854775807)
             y = aten.mul(sl, 2)
    after:   y = aten.mul(x, 2)

Removed when the output shape (and dtype) equals the input's:
``view``, ``reshape``, ``_unsafe_view``, ``expand``, ``slice`` with step 1, the identity
``permute``, and ``convert_element_type`` to the same dtype. The graph is functional, so a
removed copy (the cast) cannot be observed.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kiln.passes.base import KilnPass

aten = torch.ops.aten
_SAME_SHAPE_IS_NOOP = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.alias.default,
)


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dim() != b.dim() or a.dtype != b.dtype:
        return False
    return all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _is_noop(node: torch.fx.Node) -> bool:
    src, out = _val(node.args[0]) if node.args else None, _val(node)
    if src is None or out is None or not _same_shape(src, out):
        return False
    target = node.target
    if target in _SAME_SHAPE_IS_NOOP:
        return True
    if target == aten.slice.Tensor:
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        return step == 1  # same length and step 1: the full range
    if target == aten.permute.default:
        return list(node.args[1]) == list(range(src.dim()))
    if target == torch.ops.prims.convert_element_type.default:
        return True  # _same_shape already checked the dtype
    return False


class NoOpEliminationPass(KilnPass):
    stage = "post_grad"

    def __call__(self, graph: torch.fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and _is_noop(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                count += 1
        if count:
            graph.eliminate_dead_code()  # the sym_size reads that fed removed views
        return count
