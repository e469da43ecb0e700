"""``AttentionBackendPass``: point each generic ``kiln.attend_paged`` call at the device's kernel op.

Runs at ``dynamo`` stage, on the captured graph before it is split: the attention op is the split
point, so it never enters a piece and Inductor's passes never see it.

The hook: a kernel package (Triton on GPU, ``csrc/`` on CPU) registers an op with the schema of
``kiln::attend_paged`` for its device type::

    register_attention_kernel("cpu", torch.ops.kiln_cpu.attend_paged)

and the pass rewrites the call target::

    before:  o = torch.ops.kiln.attend_paged(q, k, v, 3, 0.125)
    after:   o = torch.ops.kiln_cpu.attend_paged(q, k, v, 3, 0.125)

With no kernel registered for the device the graph is left alone, and ``kiln.attend_paged`` runs
whatever ``kiln.ops.attention.set_attention_impl`` selected (the pure-torch reference by default).
The split point list (``kiln.compiler.split``) includes every registered kernel op, so a swapped
call still splits the graph.
"""

from __future__ import annotations

from typing import Any

import torch

import kiln.ops.attention  # noqa: F401  (registers torch.ops.kiln.attend_paged)
from kiln.passes.base import KilnPass

GENERIC_ATTENTION_OP = "kiln::attend_paged"
_kernels: dict[str, Any] = {}


def op_name(target: Any) -> str | None:
    """'ns::name' of an op overload or packet; None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def register_attention_kernel(device_type: str, op: Any) -> None:
    """Make ``op`` (same schema as ``kiln::attend_paged``) the attention kernel on ``device_type``."""
    if op_name(op) is None:
        raise TypeError(f"register_attention_kernel needs a torch.ops op, got {op!r}")
    _kernels[device_type] = op


def unregister_attention_kernel(device_type: str) -> None:
    _kernels.pop(device_type, None)


def attention_op_names() -> tuple[str, ...]:
    """The generic op and every registered kernel op: the graph's split points."""
    return (GENERIC_ATTENTION_OP, *sorted({op_name(op) for op in _kernels.values()}))


class AttentionBackendPass(KilnPass):
    stage = "dynamo"

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self.kernel = _kernels.get(device_type)

    def options(self) -> dict:
        return {"device_type": self.device_type, "kernel": op_name(self.kernel)}

    def __call__(self, graph: torch.fx.Graph) -> int:
        if self.kernel is None:
            return 0
        count = 0
        for node in graph.nodes:
            if node.op == "call_function" and op_name(node.target) == GENERIC_ATTENTION_OP:
                node.target = self.kernel
                count += 1
        return count
