"""The mixture-of-experts FFN of Mixtral, Qwen2-MoE and Qwen3-MoE (``SparseMoeBlock``).

One block replaces a layer's MLP where ``kiln.models.arch.is_sparse_layer`` says so. Per token::

    probs   = softmax(router(x)) in float32               [T, E]
    w, ids  = top-k(probs)                                [T, K]
    w      /= w.sum(-1)        if arch.norm_topk_prob     (Mixtral always; Qwen3-MoE by config)
    out     = kiln.fused_moe(x, w13, w2, w, ids)          experts' SwiGLU MLPs, weighted sum
    out    += sigmoid(shared_gate(x)) * shared_mlp(x)     Qwen2-MoE's shared expert

Numerics follow transformers: Mixtral keeps the routing weights in float32 for the product; the
Qwen families round them to the model dtype first. Routing stays in the graph (Inductor fuses
softmax, top-k and the renormalization); the experts are the opaque op ``kiln.fused_moe``, which the
compiler points at the device's kernel (``kiln.passes.moe_backend``).

Expert weights are stacked per layer: ``w13`` [E, 2I, H] (gate rows, then up rows, as the fused
dense MLP) and ``w2`` [E, H, I]. Checkpoints store one tensor per expert and projection; the
loader copies each into its slice (``weight_slices``). Under tensor parallelism every rank holds
every expert, each cut along its intermediate dimension as the dense MLP is (gate and up rows
column-parallel, down columns row-parallel; the shared expert too): the router is replicated, so
every rank routes every token alike, and the block's partial sums meet in one all-reduce. With
expert parallelism (``tp.experts``) rank r holds experts [r E / N, (r + 1) E / N) whole and
computes only its experts' share of each token (the other top-k slots weigh 0 there); the same
all-reduce combines them (dispatch by replication, vLLM's naive backend, not an all-to-all).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import kiln.ops.collective  # noqa: F401  (registers torch.ops.kiln.all_reduce)
import kiln.ops.moe  # noqa: F401  (registers torch.ops.kiln.fused_moe)
from kiln.models.arch import ArchConfig
from kiln.models.parallel import SINGLE, Shard, TensorParallel, column_shard, row_shard


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SwiGLU MLP (gate/up fused, as ``LlamaMLP``)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.family = arch.family
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.norm_topk_prob
        self.float_weights = arch.family == "mixtral"  # transformers' Mixtral never rounds them
        num_experts, hidden = arch.num_experts, arch.hidden_size
        inter = arch.moe_intermediate_size if tp.experts else arch.moe_intermediate_size // tp.size
        local = num_experts // tp.size if tp.experts else num_experts
        self.first_expert = tp.rank * local if tp.experts else 0  # this rank's experts: first_expert + [0, local)
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, inter))
        self.shared_expert = None
        self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden, arch.shared_expert_intermediate_size // tp.size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K] each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float_weights:
            weights = weights.to(x.dtype)
        if self.tp.experts:  # this rank's experts only: another's slot weighs 0 (at local expert 0)
            local = ids - self.first_expert
            mine = (local >= 0) & (local < self.w13.shape[0])
            weights, ids = torch.where(mine, weights, torch.zeros_like(weights)), torch.where(mine, local, 0)
        out = torch.ops.kiln.fused_moe(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return torch.ops.kiln.all_reduce(out) if self.tp.size > 1 else out

    def weight_slices(self, prefix: str) -> Iterator[tuple[str, torch.Tensor, Shard]]:
        """(checkpoint name, the slice of a parameter it fills, the shard of the checkpoint tensor
        this rank loads) for this block; ``prefix`` is the layer's ('model.layers.3.')."""
        inter = self.w2.shape[-1]  # this rank's
        if self.tp.experts:  # whole experts, this rank's range of them
            col = row = None
        else:
            col, row = column_shard(inter * self.tp.size, self.tp), row_shard(inter * self.tp.size, self.tp)
        if self.family == "mixtral":
            p = f"{prefix}block_sparse_moe."
            names = ("w1", "w3", "w2")  # gate, up, down
        else:
            p = f"{prefix}mlp."
            names = ("gate_proj", "up_proj", "down_proj")
        yield f"{p}gate.weight", self.gate.weight, None
        for e in range(self.w13.shape[0]):
            name = f"{p}experts.{self.first_expert + e}."
            yield f"{name}{names[0]}.weight", self.w13[e, :inter], col
            yield f"{name}{names[1]}.weight", self.w13[e, inter:], col
            yield f"{name}{names[2]}.weight", self.w2[e], row
        if self.shared_expert is not None:
            shared = self.shared_expert
            n = shared.down_proj.in_features
            scol, srow = column_shard(n * self.tp.size, self.tp), row_shard(n * self.tp.size, self.tp)
            yield f"{p}shared_expert.gate_proj.weight", shared.gate_up_proj.weight[:n], scol
            yield f"{p}shared_expert.up_proj.weight", shared.gate_up_proj.weight[n:], scol
            yield f"{p}shared_expert.down_proj.weight", shared.down_proj.weight, srow
            yield f"{p}shared_expert_gate.weight", self.shared_expert_gate.weight, None
