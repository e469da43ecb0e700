"""``SiluMulFusionPass``: ``silu(gate) * up`` on the halves of one tensor -> ``kiln.silu_and_mul``.

Runs at ``post_grad`` as part of Inductor's custom pre-pass: the pattern is traced with
``fwd_only`` through the same decompositions Inductor applies, so it matches whatever form
``silu`` decomposes to (``x / (1 + exp(-x))`` today) without spelling it out, and it runs before
Inductor's own rewrites reorder those ops.

    before:  split = aten.split.Tensor(gate_up, 1536, -1)
             gate = split[0];  up = split[1]
             neg = aten.neg(gate);  exp = aten.exp(neg);  add = aten.add(exp, 1)
             div = aten.div(gate, add);  mul = aten.mul(div, up)
    after:   mul = kiln.silu_and_mul(gate_up)

The pattern itself covers ``silu(gate) * up``; ``extra_check`` then requires gate and up to be
items 0 and 1 of one ``split`` of the last dim into two equal halves (the fused gate/up
projection), which is exactly what the op computes.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, gen_pattern, register_graph_pattern
from torch.fx.experimental.symbolic_shapes import statically_known_true

import kiln.ops.activation  # noqa: F401  (registers torch.ops.kiln.silu_and_mul)
from kiln.ops.registry import op_name
from kiln.passes.base import KilnPass, retarget

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _split_source(gate: torch.fx.Node, up: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor whose last-dim halves are gate and up, or None."""
    if gate.target is not operator.getitem or up.target is not operator.getitem:
        return None
    split = gate.args[0]
    if up.args[0] is not split or (gate.args[1], up.args[1]) != (0, 1):
        return None
    if split.target is not aten.split.Tensor:
        return None
    x, size = split.args[0], split.args[1]
    if isinstance(size, torch.fx.Node):  # a symbolic split size
        size = size.meta.get("val")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    val = x.meta.get("val")
    if val is None or dim not in (-1, val.dim() - 1):
        return None
    if size is None or not statically_known_true(val.shape[-1] == 2 * size):
        return None
    return x


def _check(match: Match) -> bool:
    return _split_source(match.kwargs["gate"], match.kwargs["up"]) is not None


def _fused(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.kiln.silu_and_mul.default(x)


@functools.cache
def _patterns() -> PatternMatcherPass:
    """Traced once per process, on first use (never at import)."""
    patterns = PatternMatcherPass(pass_name="kiln_silu_mul_fusion")
    seen = set()
    for dtype in _DTYPES:
        example = [torch.empty(4, 8, dtype=dtype), torch.empty(4, 8, dtype=dtype)]
        pattern = gen_pattern(_silu_mul, example, fwd_only)
        if repr(pattern) in seen:
            continue
        seen.add(repr(pattern))

        @register_graph_pattern(pattern, extra_check=_check, pass_dict=patterns)
        def _replace(match: Match, gate, up) -> None:
            x = _split_source(gate, up)
            match.replace_by_example(_fused, [x])

    return patterns


class SiluMulFusionPass(KilnPass):
    stage = "post_grad"

    def __init__(self, enabled: bool = True, op: Any = None) -> None:
        self.enabled = enabled
        self.op = op if op is not None else torch.ops.kiln.silu_and_mul  # the KernelSet's kernel op

    def options(self) -> dict:
        return {"enabled": self.enabled, "op": op_name(self.op)} if self.enabled else {"enabled": False}

    def __call__(self, graph: torch.fx.Graph) -> int:
        if not self.enabled:
            return 0
        count = _patterns().apply(graph)
        graph.eliminate_dead_code()
        retarget(graph, "kiln::silu_and_mul", self.op)  # the pattern writes the generic op
        return count
