"""Per-step attention metadata, handed to the attention ops through a scoped context.

The model runner builds one ``ForwardContext`` per step and enters ``forward_context(ctx)`` around
the model call. The attention op reads it with ``get_forward_context()``. The context refuses
nesting and is cleared on exit, so no op can see a stale batch.

Batch layout (flat, no padding): requests are laid out one after another in the token dimension,
decode requests (one new token each) first, then prefill chunks::

    tokens:  | r0 | r1 | r2 ........ | r3 ..... |
              decodes   prefill       prefill
    query_start_loc = [0, 1, 2, 2+q2, 2+q2+q3]

Request i's new tokens sit at context positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32
    num_decodes: int  # the first num_decodes requests have exactly one new token
    max_query_len: int
    max_seq_len: int
    # Host copies, so reference kernels need no device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardContext:
    attn: Optional[AttentionMetadata]
    # One tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V).
    kv_caches: list[torch.Tensor]
    # The kernel the generic ``kiln.attend_paged`` runs (the KernelSet's, set by the compiled
    # model); None: the pure-torch reference. Graphs compiled by kiln call the kernel's own op.
    attention_impl: Optional[Callable[..., torch.Tensor]] = None
    # FP8 caches only: per layer a float32 [2] tensor (k_scale, v_scale) on the cache's device; a
    # cached value times its scale is the real one. None: scale 1. Kernels read the tensors at run
    # time (CUDA graphs replay the current values), so calibration can set them in place.
    kv_scales: Optional[list[torch.Tensor]] = None
    # Set the step's kv_scales from its new keys and values (amax) before storing them: the first
    # step with a prefill when cache.calculate_kv_scales is on.
    calibrate_kv_scales: bool = False
    # Added to the layer_idx of every attention call: a compiled piece holding several layers'
    # attention calls numbers them from 0 and sets its first layer here while it runs, so pieces
    # that differ only in which layers they hold share one build (``kiln.compiler.piece``).
    layer_base: int = 0
    # Multi-LoRA: [>= num_tokens] int32, each token's adapter slot (0: the base model), read by
    # ``kiln.add_lora``; a persistent input buffer, so CUDA graphs replay the current step's. None:
    # the model serves no adapters.
    lora_slots: Optional[torch.Tensor] = None
    # A step with image tokens: (token rows [M] int64, their vision embeddings [M, hidden]), the
    # slices of the encoder cache this step's chunks cover, read by ``kiln.merge_mm_embeds``.
    mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None


_current: Optional[ForwardContext] = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` visible to the attention ops for the duration of one forward."""
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already active; nested forwards are not supported")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward_context is active: run the model inside `with forward_context(...)`")
    return _current
