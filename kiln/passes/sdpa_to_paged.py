"""``SDPAToPagedAttentionPass``: a model's own attention becomes kiln's paged-attention op.

Runs at ``dynamo`` stage, first, on graphs captured from unmodified transformers code
(``model.impl=transformers``, captured with ``attn_implementation="sdpa"``). Such a graph runs the
flat batch as one sequence of batch 1 and attends with ``scaled_dot_product_attention`` over the
step's own tokens under a mask it builds from the positions. Each call becomes::

    before:  k = k_rot[:, :, None].expand(1, KVH, G, T, D).reshape(1, H, T, D)     (GQA repeat, if any)
             o = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s)   q: [1, H, T, D]
    after:   o = kiln.attend_paged(q[0].transpose(0, 1).contiguous(), k_rot[0].transpose(0, 1),
                                   v[0].transpose(0, 1), layer, s).transpose(0, 1).unsqueeze(0)

so k/v (after rotary, before the GQA repeat) are written into the paged cache and each request
attends over its whole cached context. The ``layer`` of the i-th call in graph order is i (a
decoder's layers run in order); where Dynamo recorded the module path, its layer number must agree.
The mask construction and the GQA repeats are then dead and removed (dead-code elimination), with
anything else left unused.

What the mask or the model's attention function did beyond causal attention, the layer's sliding
window and logit soft-cap, the pass cannot read off SDPA: it takes them per layer
(``layer_options``, from the model: ``HFGenericForCausalLM.attention_layers``) and passes them to
the paged op where set::

    o = kiln.attend_paged(q', k', v', layer, s, window, softcap)

A call the pass cannot prove equivalent (dropout, a non-causal call without mask, q not of batch
1, differing q/v head sizes) raises: the manager restores the graph, and ``check_no_sdpa_left``
(called by the backend after the dynamo stage) then refuses the capture with the reason, so a
graph never attends over only the step's tokens. So is a graph whose number of SDPA calls differs
from the number of layers given options for. Models whose attention kiln lacks (other layer kinds,
position biases) are refused earlier, from their config (``kiln.models.hf_generic``).
"""

from __future__ import annotations

import functools
import operator
import re
from typing import Any, Optional

import torch
import torch.nn.functional as F

import kiln.ops  # noqa: F401  (registers torch.ops.kiln.attend_paged)
from kiln.passes.base import KilnPass, fake_node, keep_source_meta, node_tensor

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_LAYER_NUMBER = re.compile(r"[.\[](\d+)\]?")


def is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def _shape(node: Any) -> Optional[torch.Size]:
    val = node_tensor(node)
    return val.shape if val is not None else None


def _sdpa_args(node: torch.fx.Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    return args


def _unrepeat(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor before transformers' ``repeat_kv`` (x[:, :, None].expand(...).reshape(...)),
    or ``node`` itself when it is not one."""
    if not (isinstance(node, torch.fx.Node) and _is_method_or_fn(node, "reshape")):
        return node
    expand = node.args[0]
    if not (isinstance(expand, torch.fx.Node) and _is_method_or_fn(expand, "expand")):
        return node
    index = expand.args[0]
    if not (isinstance(index, torch.fx.Node) and index.op == "call_function" and index.target is operator.getitem):
        return node
    src, key = index.args
    full = slice(None, None, None)
    if key != (full, full, None, full, full):
        return node
    return src


def _is_method_or_fn(node: torch.fx.Node, name: str) -> bool:
    if node.op == "call_method":
        return node.target == name
    return node.op == "call_function" and getattr(node.target, "__name__", None) == name


def _module_layer(node: torch.fx.Node) -> Optional[int]:
    """The layer number in the module path Dynamo recorded for ``node`` (the innermost module
    whose path holds a number), or None."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        numbers = _LAYER_NUMBER.findall(str(path))
        if numbers:
            return int(numbers[-1])
    return None


class SDPAToPagedAttentionPass(KilnPass):
    stage = "dynamo"

    def __init__(self, layer_options: tuple[tuple[int, float], ...] = ()) -> None:
        # (sliding window, logit soft-cap) per layer, 0 where unset; () when no layer has either.
        self.layer_options = tuple((int(w), float(c)) for w, c in layer_options)
        self.num_dead_removed = 0  # nodes the last run removed as dead (mask construction, GQA repeats)

    def options(self) -> dict[str, Any]:
        return {"layer_options": self.layer_options}

    def __call__(self, graph: torch.fx.Graph) -> int:
        calls = [n for n in graph.nodes if is_sdpa(n)]
        if not calls:
            return 0
        if self.layer_options and len(calls) != len(self.layer_options):
            raise ValueError(f"{len(calls)} attention calls in the graph, but options for {len(self.layer_options)} "
                             "layers (sliding windows, soft-caps): cannot tell which call is which layer")
        for layer, node in enumerate(calls):
            self._rewrite(graph, node, layer)
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        self.num_dead_removed = before - len(graph.nodes)
        return len(calls)

    def _rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node, layer: int) -> None:
        a = _sdpa_args(node)
        where = f"{node.name} (layer {layer})"
        if a.get("dropout_p", 0.0) not in (0, 0.0):
            raise ValueError(f"{where}: attention dropout {a['dropout_p']} (kiln runs inference only)")
        # is_causal may be a traced condition (transformers: q_len > 1 and no mask), true wherever it matters.
        if a.get("attn_mask") is None and not (a.get("is_causal") is True or isinstance(a.get("is_causal"),
                                                                                         torch.fx.Node)):
            raise ValueError(f"{where}: attention without a mask and not causal (kiln's paged attention is causal)")
        module_layer = _module_layer(node)
        if module_layer is not None and module_layer != layer:
            raise ValueError(f"{where}: attention call {layer} in graph order is in module layer {module_layer}")
        q, k, v = a["query"], _unrepeat(a["key"]), _unrepeat(a["value"])
        q_shape, k_shape, v_shape = _shape(q), _shape(k), _shape(v)
        if q_shape is None or k_shape is None or v_shape is None:
            raise ValueError(f"{where}: q, k or v has no recorded shape")
        if len(q_shape) != 4 or q_shape[0] != 1:
            raise ValueError(f"{where}: q has shape {tuple(q_shape)}, expected [1, heads, tokens, head_dim]")
        if q_shape[-1] != v_shape[-1] or k_shape[-1] != q_shape[-1]:
            raise ValueError(f"{where}: q, k and v head sizes differ ({q_shape[-1]}, {k_shape[-1]}, {v_shape[-1]})")
        if q_shape[1] % k_shape[1] != 0:
            raise ValueError(f"{where}: {q_shape[1]} query heads are not a multiple of {k_shape[1]} kv heads")
        scale = a.get("scale")
        scale = float(scale) if scale is not None else float(q_shape[-1]) ** -0.5
        call = functools.partial(fake_node, graph)  # (kind, target, args) -> node

        with graph.inserting_before(node):
            flat = [call("call_function", torch.transpose, (call("call_function", torch.select, (x, 0, 0)), 0, 1))
                    for x in (q, k, v)]  # [T, heads, D]
            # q in token-major layout: the kernels' output (contiguous) then matches their fake
            # (shaped like q), and Inductor writes the rotary result in that layout at no cost.
            flat[0] = call("call_method", "contiguous", (flat[0],))
            window, softcap = self.layer_options[layer] if self.layer_options else (0, 0.0)
            extra = (window, softcap) if window or softcap else ()  # unset: the same graph as without options
            o = call("call_function", torch.ops.kiln.attend_paged.default, (*flat, layer, scale, *extra))  # [T, H, D]
            out = call("call_function", torch.unsqueeze, (call("call_function", torch.transpose, (o, 0, 1)), 0))
        keep_source_meta(out, node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def check_no_sdpa_left(graph: torch.fx.Graph) -> None:
    """Refuse a captured graph whose ``scaled_dot_product_attention`` was not made paged: it would
    attend over the step's own tokens only (wrong tokens after the first step)."""
    left = [n.name for n in graph.nodes if is_sdpa(n)]
    if left:
        raise RuntimeError(f"kiln: the captured graph still calls scaled_dot_product_attention ({len(left)}x, "
                           f"first {left[0]}) after SDPAToPagedAttentionPass, which could not rewrite it (its "
                           "warning above says why); this model cannot run in compile.mode=kiln. Try "
                           "compile.mode=eager or stock.")
