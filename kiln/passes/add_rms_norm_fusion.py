"""``AddRMSNormFusionPass``: residual add + RMSNorm -> ``kiln.add_rms_norm``.

Runs at ``post_grad`` as Inductor's custom *pre*-pass. That placement matters: Inductor's own
post-grad patterns fold the residual add into the preceding ``o_proj``/``down_proj`` matmul
(``addmm`` with the residual as bias), after which the add no longer exists to match. The
pattern is traced with ``fwd_only`` through Inductor's decompositions, once per dtype (bf16 and
fp16 carry float32 casts around the statistics, float32 has none).

    before:  add = aten.add(residual, x)
             pow = aten.pow(add, 2);  mean = aten.mean(pow, [-1], True)
             eps = aten.add(mean, 1e-05);  rsqrt = aten.rsqrt(eps)
             mul = aten.mul(add, rsqrt);  out = aten.mul(weight, mul)
    after:   fused = kiln.add_rms_norm(x, residual, weight, 1e-05)
             out = fused[0];  add = fused[1]        # add keeps its other users (the next residual)

Inputs of higher rank are viewed as rows ``[-1, hidden]`` around the op (the kernels take rows).

The first layer's input norm (on the embedding, no add) is not matched and stays as it is.
``eps`` is matched as any scalar (``scalar_workaround``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

import kiln.ops.layernorm  # noqa: F401  (registers torch.ops.kiln.add_rms_norm)
from kiln.ops.layernorm import rms_norm_reference
from kiln.ops.registry import op_name
from kiln.passes.base import KilnPass, retarget

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EPS_EXAMPLE = 9.87654e-6  # any value that appears nowhere else in the pattern


def _search(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    new_residual = residual + x
    return rms_norm_reference(new_residual, weight, eps), new_residual


def _replace(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    # The kernels take rows: a model with a batch dimension ([1, T, hidden], as transformers'
    # modeling code has) is viewed as [T, hidden] around the op, so the kernel, not its reference
    # fallback, runs.
    rows = (-1, x.shape[-1])
    fused = torch.ops.kiln.add_rms_norm.default(x.reshape(rows), residual.reshape(rows), weight, eps)
    return fused[0].view(x.shape), fused[1].view(x.shape)


@functools.cache
def _patterns() -> PatternMatcherPass:
    """Traced once per process, on first use (never at import)."""
    patterns = PatternMatcherPass(pass_name="kiln_add_rms_norm_fusion")
    for dtype in _DTYPES:
        example = [torch.empty(4, 8, dtype=dtype), torch.empty(4, 8, dtype=dtype), torch.empty(8, dtype=dtype)]
        register_replacement(
            _search, _replace, example, fwd_only, patterns,
            scalar_workaround={"eps": _EPS_EXAMPLE}, skip_duplicates=True,
        )
    return patterns


class AddRMSNormFusionPass(KilnPass):
    stage = "post_grad"

    def __init__(self, enabled: bool = True, op: Any = None) -> None:
        self.enabled = enabled
        self.op = op if op is not None else torch.ops.kiln.add_rms_norm  # the KernelSet's kernel op

    def options(self) -> dict:
        return {"enabled": self.enabled, "op": op_name(self.op)} if self.enabled else {"enabled": False}

    def __call__(self, graph: torch.fx.Graph) -> int:
        if not self.enabled:
            return 0
        count = _patterns().apply(graph)
        retarget(graph, "kiln::add_rms_norm", self.op)  # the pattern writes the generic op
        return count
