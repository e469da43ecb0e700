"""Tensor parallelism for the Llama family: who holds which slice of every weight.

The plan is Megatron's, on the fused projections kiln already uses::

    x ─┬─ qkv_proj  (column-parallel: this rank's q heads, k/v heads)  ─ attention ─ o_proj (row-parallel) ─ all_reduce
       └─ gate_up_proj (column-parallel: this rank's rows of gate and up) ─ silu*mul ─ down_proj (row-parallel) ─ all_reduce

Column-parallel: a rank holds a contiguous range of output rows, so its output is a slice of the
full one and needs no communication. Row-parallel: a rank holds the matching input columns, so its
output is a partial sum, and one ``torch.ops.kiln.all_reduce`` per block restores the full
activation. Norms are replicated. Embedding and LM head are vocab-parallel: a rank holds a
contiguous range of vocabulary rows (the tied head shares the embedding's shard), so no rank keeps
``vocab x hidden`` weights whole::

    ids ─ embed (this rank's rows; other ids -> 0) ─ all_reduce ─ layers ─ norm ─ lm_head (this rank's rows) ─ all_gather ─ logits

After the gather every rank holds the full logits; rank 0 alone samples, but every rank computes
logits whenever any row samples, since the gather needs the whole group.

Rules kept here:
- ``TensorParallel(rank=0, size=1)`` is exactly the single-device model: no shard, no collective.
- Heads split evenly: ``num_heads % size == 0``. KV heads split when ``num_kv_heads % size == 0``
  and are replicated when ``size % num_kv_heads == 0`` (GQA with fewer KV heads than ranks: each
  KV head serves ``size // num_kv_heads`` ranks). Anything else is a ValueError before any rank starts.
- The vocabulary pads up to a multiple of ``size``: the padding rows (on the last rank(s)) are zero
  and their logits are cut off after the gather, so the sampler sees exactly ``vocab_size`` columns.
- Weights shard on load: a rank copies only its slice of each Hugging Face tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kiln.models.arch import ArchConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    # Expert parallelism (parallel.enable_expert_parallel): a mixture-of-experts block's experts are
    # placed whole across the group's ranks rather than each cut along its intermediate dimension.
    experts: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of size {self.size}")


SINGLE = TensorParallel()

# (dim, start, length): the slice of a full Hugging Face tensor that one rank loads.
Shard = Optional[tuple[int, int, int]]


def check_tensor_parallel(arch: ArchConfig, size: int, experts: bool = False) -> None:
    """Raise a ValueError naming the first dimension that ``size`` ranks cannot split."""
    if size == 1:
        return
    problems = []
    if arch.num_heads % size:
        problems.append(f"num_heads={arch.num_heads}")
    if arch.num_kv_heads % size and size % arch.num_kv_heads:
        problems.append(f"num_kv_heads={arch.num_kv_heads} (neither a multiple nor a divisor)")
    if arch.intermediate_size % size:
        problems.append(f"intermediate_size={arch.intermediate_size}")
    cut = ("shared_expert_intermediate_size",) if experts else ("moe_intermediate_size",
                                                                 "shared_expert_intermediate_size")
    for key in cut:  # each expert is cut too (with expert parallelism, the shared one only)
        value = getattr(arch, key, 0) or 0
        if value % size:
            problems.append(f"{key}={value}")
    if experts and (arch.num_experts or 0) % size:
        problems.append(f"num_experts={arch.num_experts} (parallel.enable_expert_parallel places them whole)")
    if problems:
        raise ValueError(f"parallel.tensor_parallel_size={size} does not divide this model's "
                         f"{', '.join(problems)}; choose a size that divides num_heads={arch.num_heads} "
                         f"and num_kv_heads={arch.num_kv_heads}, or use tensor_parallel_size=1")


def local_num_heads(arch: ArchConfig, tp: TensorParallel) -> int:
    return arch.num_heads // tp.size


def local_num_kv_heads(arch: ArchConfig, tp: TensorParallel) -> int:
    return max(1, arch.num_kv_heads // tp.size)


def local_intermediate_size(arch: ArchConfig, tp: TensorParallel) -> int:
    return arch.intermediate_size // tp.size


def head_shards(arch: ArchConfig, tp: TensorParallel) -> dict[str, Shard]:
    """Row ranges of q_proj, k_proj, v_proj (weights and biases) that this rank loads."""
    if tp.size == 1:
        return {"q_proj": None, "k_proj": None, "v_proj": None}
    d = arch.head_dim
    num_heads, num_kv = local_num_heads(arch, tp), local_num_kv_heads(arch, tp)
    # rank * KVH // size: a contiguous range when KV heads split, the shared head when they replicate.
    kv_start = tp.rank * arch.num_kv_heads // tp.size
    kv: Shard = (0, kv_start * d, num_kv * d)
    return {"q_proj": (0, tp.rank * num_heads * d, num_heads * d), "k_proj": kv, "v_proj": kv}


def column_shard(full_rows: int, tp: TensorParallel) -> Shard:
    """Column-parallel Linear weight [out, in]: this rank's range of output rows."""
    if tp.size == 1:
        return None
    n = full_rows // tp.size
    return (0, tp.rank * n, n)


def row_shard(full_cols: int, tp: TensorParallel) -> Shard:
    """Row-parallel Linear weight [out, in]: this rank's range of input columns."""
    if tp.size == 1:
        return None
    n = full_cols // tp.size
    return (1, tp.rank * n, n)


def vocab_range(arch: ArchConfig, tp: TensorParallel) -> tuple[int, int]:
    """(first id, number of rows) of this rank's range of the padded vocabulary."""
    num_rows = -(-arch.vocab_size // tp.size)
    return tp.rank * num_rows, num_rows


def vocab_shard(arch: ArchConfig, tp: TensorParallel) -> tuple[Shard, int]:
    """Embedding / LM head weight [vocab, hidden]: the rows this rank loads and how many of its
    rows they fill (fewer than ``vocab_range``'s on a rank that holds padding)."""
    if tp.size == 1:
        return None, arch.vocab_size
    start, num_rows = vocab_range(arch, tp)
    start = min(start, arch.vocab_size)
    num_real = min(num_rows, arch.vocab_size - start)
    return (0, start, num_real), num_real


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` over every rank of the default group, every stage's of a pipeline
    too (every rank must agree, e.g. on the KV block count); ``value`` itself outside a group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
