"""Split the captured graph at the attention ops into pieces.

``split_graph`` cuts before and after every call to a split op, so the graph becomes
``piece, attention, piece, attention, ..., piece``: Inductor compiles the pieces, the attention
calls stay opaque and run eagerly (they read the KV cache and metadata from the forward context).
A Llama model with L layers gives L + 1 pieces; all but the first and last are the same code
(o_proj, residual, MLP, next layer's norm, qkv_proj, rotary), which ``kiln.compiler.piece``
compiles once. With ``compile.cudagraph=piecewise`` every piece is also captured as a CUDA graph per
capture size, attention still eager between them (``kiln.compiler.piecewise``).

The split points are one list: ``KernelSet.split_op_names()`` = the generic attention op plus the
set's attention kernel op (``kiln.ops.registry``).

``compile.split_every`` N > 1 cuts at every Nth attention call only (0: nowhere), the other calls
compiled inside the pieces as extern kernels: fewer piece calls a step and fusion across the calls,
for longer first compiles (groups of N layers are one build). Piecewise CUDA graphs need N = 1.
The attention calls inside a piece are numbered from its first layer (``number_layers_from_zero``)
so that pieces holding different layers of the same code are one build too (30 layers at N = 10:
three builds, not four).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional

import torch
from torch.fx.passes.split_module import split_module

from kiln.ops.registry import GENERIC_ATTENTION_OP, op_name


@dataclass
class Piece:
    name: str  # attribute of the split GraphModule: submod_<i>
    graph_module: torch.fx.GraphModule
    is_split_op: bool  # True: one attention call, run as is; False: compiled by Inductor


def split_graph(gm: torch.fx.GraphModule, split_op_names: Collection[str] = (GENERIC_ATTENTION_OP,),
                every: int = 1) -> tuple[torch.fx.GraphModule, list[Piece]]:
    """Cut ``gm`` at the 1st, (every + 1)-th, (2 every + 1)-th ... call of a split op (every one
    with ``every`` 1, none with 0); the calls not cut at stay inside the pieces Inductor compiles."""
    split_ops = set(split_op_names)
    index = 0
    seen = 0
    split_op_pieces: set[int] = set()
    assignment: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and op_name(node.target) in split_ops and every > 0:
            seen += 1
            if (seen - 1) % every:
                assignment[node] = index
                continue
            index += 1
            assignment[node] = index
            split_op_pieces.add(index)
            index += 1
        else:
            assignment[node] = index
    split_gm = split_module(gm, None, lambda node: assignment[node], keep_original_order=True)
    pieces = [
        Piece(name, module, int(name.removeprefix("submod_")) in split_op_pieces)
        for name, module in split_gm.named_children()
    ]
    return split_gm, pieces


def _layer_idx_position(target) -> Optional[int]:
    """Position of the ``layer_idx`` argument of an op's schema (every attention op has one)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    if not isinstance(target, torch._ops.OpOverload):
        return None
    names = [a.name for a in target._schema.arguments]
    return names.index("layer_idx") if "layer_idx" in names else None


def number_layers_from_zero(gm: torch.fx.GraphModule) -> int:
    """Rewrite the ``layer_idx`` of ``gm``'s attention calls relative to the lowest one and return
    that (0 when there are none): the piece is then run with ``kiln.ops.attention.set_layer_base``
    of it. Two groups of layers differ in nothing else, so their pieces get the same key."""
    calls = []
    for node in gm.graph.nodes:
        pos = _layer_idx_position(node.target) if node.op == "call_function" else None
        if pos is None:
            continue
        in_args = pos < len(node.args)
        value = node.args[pos] if in_args else node.kwargs.get("layer_idx")
        if not isinstance(value, int):
            raise RuntimeError(f"kiln: attention call {node.name} has a layer_idx that is not a constant ({value!r})")
        calls.append((node, pos, in_args, value))
    base = min((value for *_, value in calls), default=0)
    if base == 0:
        return 0
    for node, pos, in_args, value in calls:
        if in_args:
            node.args = (*node.args[:pos], value - base, *node.args[pos + 1:])
        else:
            node.kwargs = {**node.kwargs, "layer_idx": value - base}
    gm.recompile()
    return base
