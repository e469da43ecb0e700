"""``RopeAttentionFusionPass``: the rotary embedding of q and k moves into the attention op.

Runs at ``dynamo`` stage, after ``AttentionBackendPass``, on the graph before it is split. The
Llama family's rotary (``kiln.models.llama.apply_rope``: rotate-half, neox layout) is an
elementwise kernel of its own in every layer's piece; the KernelSet's rotating attention kernel
(``AttentionKernel.rope_op``, on CUDA the Triton decode kernel) rotates q and the new key as it
loads them instead, so a decode step runs one kernel fewer a layer. q and k of one projection
rotate together (the layer's ``qk``), or one at a time (q/k norms: Qwen3)::

    before:  qk = view(split(qkv)[0], [-1, H + KVH, D])
             r = qk * cos + roll(qk, D / 2, dims=-1) * sin_signed
             q, k = split(r, [H, KVH], dim=1)
             o = kiln_triton.attend_paged(q, k, v, layer, scale, ...)
    after:   q, k = split(qk, [H, KVH], dim=1)
             o = kiln_triton.attend_paged_rope(q, k, v, cos, sin_signed, layer, scale, ...)

Partial rotary (R < D: ``cat((rotate(x[..., :R]), x[..., R:]), dim=-1)``) matches too; the kernel
rotates the first R dims. cos and sin_signed are the model's per-token [T, 1, R] tables (any rope
type whose table is indexed by position: default, linear, llama3, YaRN, LongRoPE, Gemma 3's local
one), so the pass needs no knowledge of the scaling. Anything else feeding the attention op (the
generic path's transformers rotary, no rotary at all) does not match and is left as it was; the
rotary nodes that lose their last user are erased.

Enabled where the set has a rotating kernel and fusions are on (``PassConfig.fusion``: auto means
the kernel is ``fast``, so CUDA); ``kernels.rope_join=false`` (the KernelSet's ``options``) turns it
off, to measure. Both are options, so the artifact cache keys on them.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from kiln.ops.registry import GENERIC_ATTENTION_OP, KernelSet, op_name, reference_kernels
from kiln.passes.base import KilnPass, fake_node, keep_source_meta, node_tensor

_ADDS = (operator.add, torch.add)
_MULS = (operator.mul, torch.mul)
_FULL = slice(None, None, None)


def _is(node: Any, targets: tuple, method: Optional[str] = None) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_method":
        return method is not None and node.target == method
    return node.op == "call_function" and node.target in targets


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _last_dim(dim: Any, ndim: int) -> bool:
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _match_rotate(node: Any) -> Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]]:
    """(x, cos, sin_signed) of ``x * cos + roll(x, R / 2, dims=-1) * sin_signed`` over all R dims
    of x [T, n, R], with cos and sin_signed [T or 1, 1, R]; None for anything else."""
    if not _is(node, _ADDS, "add") or len(node.args) != 2 or node.kwargs:
        return None
    for plain, rolled in (node.args, node.args[::-1]):
        if not (_is(plain, _MULS, "mul") and _is(rolled, _MULS, "mul")):
            continue
        for x, cos in (plain.args, plain.args[::-1]):
            for roll, sin in (rolled.args, rolled.args[::-1]):
                if _is(roll, (torch.roll,), "roll") and roll.args[0] is x and _rotates(x, roll, cos, sin):
                    return x, cos, sin
    return None


def _rotates(x: Any, roll: torch.fx.Node, cos: Any, sin: Any) -> bool:
    xv, cv, sv = node_tensor(x), node_tensor(cos), node_tensor(sin)
    if xv is None or cv is None or sv is None or xv.dim() != 3 or not xv.is_floating_point():
        return False
    rot = xv.shape[-1]
    if not (isinstance(rot, int) and rot % 2 == 0):
        return False
    shift, dims = _arg(roll, 1, "shifts"), _arg(roll, 2, "dims")
    shift = shift[0] if isinstance(shift, (tuple, list)) and len(shift) == 1 else shift
    if shift != rot // 2 or not _last_dim(dims, 3):
        return False
    return all(t.dim() == 3 and t.shape[1] == 1 and t.shape[2] == rot and t.is_floating_point() for t in (cv, sv))


def _head_slice(node: Any, start: Optional[int], stop: Optional[int]) -> Optional[torch.fx.Node]:
    """x of ``x[..., start:stop]`` (Ellipsis or full slices before the last dim), else None."""
    if not (_is(node, (operator.getitem,)) and len(node.args) == 2):
        return None
    x, key = node.args
    xv = node_tensor(x)
    if xv is None or not isinstance(key, tuple) or not key or key[-1] != slice(start, stop, None):
        return None
    lead = key[:-1]
    if lead == (Ellipsis,) or (len(lead) == xv.dim() - 1 and all(k == _FULL for k in lead)):
        return x
    return None


def match_rope(node: Any) -> Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]]:
    """(x before its rotary, cos, sin_signed) where ``node`` is ``apply_rope(x, cos, sin_signed)``:
    the whole head, or its first R dims with the rest passed through; None for anything else."""
    whole = _match_rotate(node)
    if whole is not None:
        return whole
    if not _is(node, (torch.cat,)) or not _last_dim(_arg(node, 1, "dim", 0), 3):
        return None
    parts = node.args[0]
    if not (isinstance(parts, (tuple, list)) and len(parts) == 2):
        return None
    head = _match_rotate(parts[0])
    if head is None:
        return None
    rot = node_tensor(head[0]).shape[-1]
    x = _head_slice(head[0], None, rot)
    if x is None or _head_slice(parts[1], rot, None) is not x:
        return None
    return x, head[1], head[2]


class RopeAttentionFusionPass(KilnPass):
    stage = "dynamo"

    def __init__(self, kernels: KernelSet | None = None, enabled: bool = False) -> None:
        self.kernels = kernels or reference_kernels()
        self.op = self.kernels.attention.rope_op
        self.enabled = enabled and self.op is not None

    def options(self) -> dict[str, Any]:
        if not self.enabled:
            return {"enabled": False}
        return {"enabled": True, "op": self.kernels.attention.rope_op_name}

    def __call__(self, graph: torch.fx.Graph) -> int:
        if not self.enabled:
            return 0
        names = {GENERIC_ATTENTION_OP, self.kernels.attention.op_name}
        calls = [n for n in graph.nodes if n.op == "call_function" and op_name(n.target) in names]
        return sum(self._rewrite(graph, node) for node in calls)

    def _rewrite(self, graph: torch.fx.Graph, attn: torch.fx.Node) -> int:
        q, k = attn.args[0], attn.args[1]
        joint = _match_joint(q, k)
        if joint is not None:
            split, (x, cos, sin) = joint
            with graph.inserting_after(split):
                new_split = fake_node(graph, split.op, split.target, (x, *split.args[1:]), dict(split.kwargs))
            with graph.inserting_after(new_split):
                q_new = fake_node(graph, "call_function", operator.getitem, (new_split, 0))
                k_new = fake_node(graph, "call_function", operator.getitem, (new_split, 1))
            dead = [q, k, split, *_rope_nodes(split.args[0])]
        else:
            mq, mk = match_rope(q), match_rope(k)
            if mq is None or mk is None or mq[1:] != mk[1:]:
                return 0
            q_new, k_new, (cos, sin) = mq[0], mk[0], mq[1:]
            dead = [*_rope_nodes(q), *_rope_nodes(k)]
        with graph.inserting_before(attn):
            new = fake_node(graph, "call_function", self.op.default,
                            (q_new, k_new, attn.args[2], cos, sin, *attn.args[3:]), dict(attn.kwargs))
        keep_source_meta(new, attn)
        attn.replace_all_uses_with(new)
        graph.erase_node(attn)
        _erase_unused(graph, dead)
        return 1


def _match_joint(q: Any, k: Any) -> Optional[tuple[torch.fx.Node, tuple]]:
    """(split, match_rope of its input) where q, k = split(apply_rope(qk), [H, KVH], dim=1)."""
    if not (_is(q, (operator.getitem,)) and _is(k, (operator.getitem,))):
        return None
    split = q.args[0]
    if k.args[0] is not split or (q.args[1], k.args[1]) != (0, 1) or not _is(split, (torch.split,), "split"):
        return None
    sizes, dim = _arg(split, 1, "split_size"), _arg(split, 2, "dim", 0)
    if not (isinstance(sizes, (tuple, list)) and len(sizes) == 2 and dim in (1, -2)):
        return None
    rope = match_rope(split.args[0])
    return (split, rope) if rope is not None else None


def _rope_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes of ``apply_rope`` that ends in ``node``, outputs first."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(a for a in n.args if _is(a, _MULS + (torch.roll, operator.getitem), "mul")
                    or _is(a, (torch.roll,), "roll"))
        if _is(n, (torch.cat,)):
            todo.extend(p for p in n.args[0] if isinstance(p, torch.fx.Node))
    return out


def _erase_unused(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase those of ``nodes`` left without users (repeatedly: erasing one frees its inputs)."""
    left = list(dict.fromkeys(nodes))
    changed = True
    while changed:
        changed = False
        for n in list(left):
            if not n.users:
                graph.erase_node(n)
                left.remove(n)
                changed = True
