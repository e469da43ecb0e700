"""Draft-model proposer: a smaller model with the target's vocabulary guesses k tokens greedily.

The draft is a model kiln loads like the target, compiled by its own ``CompiledModel`` (its own
compile mode and CUDA graphs) over its own KV cache tensors. Those hold as many blocks as the
target's and are indexed by the same block tables, so the scheduler's one block budget covers both
and a block freed, cached or preempted is so for both models.

Per step (``propose``), before the target's forward::

    1. catch-up: one forward over every scheduled request's tokens the draft has not seen
       (prefill chunks as the target runs them; for a decoding request the tokens emitted since
       its last proposal), whose last row gives d_1 for each speculating request
    2. k - 1 decode forwards over the speculating requests: d_{j-1} in, d_j out (argmax)

Rules kept here:
- The draft writes K/V wherever the target does in the same step (its catch-up ends where the
  target's known tokens end), so a prefix-cache hit is valid for the draft too.
- Its K/V past a request's known tokens (positions of d_1..d_{k-1}) are never trusted: the next
  catch-up starts at the known tokens' end of the last proposal. A preempted request (start 0)
  starts over.
- Greedy proposals make the proposer deterministic, which the exact rejection sampler assumes
  (``kiln.runtime.rejection_sampler``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import numpy as np
import torch

from kiln.compiler import ArtifactCache, CompiledModel, InputLimits, ModelInputs
from kiln.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, resolve_for_device
from kiln.models.loader import load_model, resolve_dtype
from kiln.ops.registry import KernelSet
from kiln.runtime.input_batch import InputBatch
from kiln.runtime.kv_sizing import KVShape
from kiln.runtime.sampler import host_to_device
from kiln.runtime.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DraftTarget:
    """What the draft must match of the target, and the step limits it shares."""

    model: ModelConfig
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int


class DraftProposer:
    def __init__(self, spec: SpeculativeConfig, target: DraftTarget, cache_config: CacheConfig, kernels: KernelSet):
        self.k = spec.num_speculative_tokens
        dtype = target.dtype if spec.draft_dtype == "auto" else resolve_dtype(spec.draft_dtype, target.device)
        config = dataclasses.replace(target.model, model=spec.draft_model, dtype=str(dtype).removeprefix("torch."),
                                     max_model_len=target.max_model_len)
        try:
            self.loaded = load_model(config, cache_config.resolved_dir, target.device, dtype)
        except ValueError as e:
            raise ValueError(f"speculative.draft_model={spec.draft_model!r}: {e}") from e
        arch = self.loaded.arch
        if arch.vocab_size != target.vocab_size:
            raise ValueError(f"speculative.draft_model={spec.draft_model!r} has a vocabulary of {arch.vocab_size} "
                             f"tokens, the target {target.vocab_size}; a draft must share the target's tokenizer")
        self.block_size = target.block_size
        # A catch-up may hold up to k + 1 tokens of a request that decodes one: room past the budget.
        limits = InputLimits(target.max_num_batched_tokens + target.max_num_seqs * self.k, target.max_num_seqs,
                             -(-target.max_model_len // target.block_size))
        # The draft's `auto` compile settings resolve as the target's do, for the target's step limits.
        draft_compile, _ = resolve_for_device(
            spec.draft_compile, SchedulerConfig(max_num_seqs=target.max_num_seqs,
                                                max_num_batched_tokens=target.max_num_batched_tokens),
            target.device.type)
        self.compiled = CompiledModel(self.loaded.model, draft_compile, kernels, limits, target.max_model_len,
                                      ArtifactCache(cache_config.resolved_dir, self.loaded.name))
        self.input_batch = InputBatch(self.compiled.inputs, target.block_size)
        self.kv_shape = KVShape(arch.num_layers, target.block_size, arch.num_kv_heads, arch.head_dim, dtype)
        self._computed: dict[str, int] = {}  # request id -> tokens whose draft K/V are known good

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.compiled.bind_kv_caches(kv_caches)
        self.compiled.capture_graphs()

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        """Up to ``num_lookahead_tokens`` greedy draft tokens per speculating request."""
        speculating = [s for s in sched.scheduled if s.num_lookahead_tokens and s.samples]
        tokens = self._catch_up(sched, [s.request.request_id for s in speculating])
        if tokens is None:
            return {}
        drafts = [[t] for t in tokens.tolist()]
        for j in range(1, max(s.num_lookahead_tokens for s in speculating)):
            live = [b for b, s in enumerate(speculating) if s.num_lookahead_tokens > j]
            next_ids = self._decode([speculating[b] for b in live], [drafts[b][-1] for b in live], j).tolist()
            for b, t in zip(live, next_ids):
                drafts[b].append(t)
        return {s.request.request_id: d for s, d in zip(speculating, drafts)}

    def _catch_up(self, sched: SchedulerOutput, speculating_ids: list[str]) -> Optional[torch.Tensor]:
        """The catch-up forward (every scheduled request); d_1 of each speculating request, in order."""
        buf = self.compiled.inputs
        wanted = set(speculating_ids)
        query_lens, seq_lens, sample_rows = [], [], []
        num_tokens = 0
        buf.qsl_np[0] = 0
        for i, s in enumerate(sched.scheduled):
            rid = s.request.request_id
            end = s.start + s.num_new_tokens - s.num_lookahead_tokens  # where the target's known tokens end
            start = min(self._computed.get(rid, s.start), s.start)
            ids = s.request.token_ids_slice(start, end)
            buf.table_np[i, :len(s.block_ids)] = s.block_ids
            self.input_batch.write_chunk(i, num_tokens, start, ids)
            num_tokens += len(ids)
            buf.seq_lens_np[i] = end
            buf.qsl_np[i + 1] = num_tokens
            query_lens.append(len(ids))
            seq_lens.append(end)
            self._computed[rid] = end
            if rid in wanted:
                sample_rows.append(num_tokens - 1)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        out = self.compiled.run(ModelInputs(num_tokens, num_decodes, query_lens, seq_lens))
        if not sample_rows:
            return None
        rows = host_to_device(sample_rows, out.hidden.device)
        return self.loaded.model.compute_logits(out.hidden[rows]).argmax(dim=-1)

    def _decode(self, scheduled: list, token_ids: list[int], j: int) -> torch.Tensor:
        """Draft step j: token d_j of each request in at its position, the argmax of d_{j+1} out."""
        buf, bs = self.compiled.inputs, self.block_size
        positions = []
        for i, (s, token) in enumerate(zip(scheduled, token_ids)):
            pos = s.request.num_tokens - 1 + j  # d_j follows the last known token
            buf.table_np[i, :len(s.block_ids)] = s.block_ids
            buf.ids_np[i] = token
            buf.pos_np[i] = pos
            buf.slot_np[i] = s.block_ids[pos // bs] * bs + pos % bs
            buf.seq_lens_np[i] = pos + 1
            positions.append(pos + 1)
        n = len(scheduled)
        buf.qsl_np[:n + 1] = np.arange(n + 1)
        out = self.compiled.run(ModelInputs(n, n, [1] * n, positions))
        logits = out.logits[:n] if out.logits is not None else self.loaded.model.compute_logits(out.hidden[:n])
        return logits.argmax(dim=-1)
