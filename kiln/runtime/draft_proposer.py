"""Draft-model proposer: a smaller model with the target's vocabulary guesses k tokens greedily.

The draft is a model kiln loads like the target, compiled by its own ``CompiledModel`` (its own
compile mode and CUDA graphs) over its own KV cache tensors. Those hold as many blocks as the
target's and are indexed by the same block tables, so the scheduler's one block budget covers both
and a block freed, cached or preempted is so for both models.

Per step (``propose``), before the target's forward::

    1. catch-up: one forward over every scheduled request's tokens the draft has not seen
       (prefill chunks as the target runs them; for a decoding request the tokens emitted since
       its last proposal, widened to k + 1 so a decode-only step is uniform and replays a full
       graph), whose last row gives d_1 for each speculating request
    2. k - 1 decode forwards over the speculating requests: d_{j-1} in, d_j out (argmax), the
       tokens kept on the device between steps and read back once at the end

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

from kiln.compiler import ArtifactCache, CompiledModel, InputLimits, ModelInputs, VerifyShape
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
        # The draft's `auto` compile settings resolve as the target's do, for the target's step limits,
        # but never to a background build (kiln.config.resolve_for_device).
        draft_compile, _ = resolve_for_device(
            spec.draft_compile, SchedulerConfig(max_num_seqs=target.max_num_seqs,
                                                max_num_batched_tokens=target.max_num_batched_tokens),
            target.device.type, can_background=False)
        self.compiled = CompiledModel(self.loaded.model, draft_compile, kernels, limits, target.max_model_len,
                                      ArtifactCache(cache_config.resolved_dir, self.loaded.name))
        # Catch-ups of decoding requests are k + 1 tokens each (``_catch_up``): full graphs for them too.
        self.compiled.set_verify_shape(VerifyShape(self.k + 1, min(spec.max_batch_size, target.max_num_seqs)))
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
        """Up to ``num_lookahead_tokens`` greedy draft tokens per speculating request.

        The tokens stay on the device from one draft step to the next (each step's argmax is the
        next step's input, copied into the input buffer after the upload): one read-back per
        step, not one per draft token."""
        speculating = [s for s in sched.scheduled if s.num_lookahead_tokens and s.samples]
        first = self._catch_up(sched, [s.request.request_id for s in speculating])
        if first is None:
            return {}
        num_drafts = max(s.num_lookahead_tokens for s in speculating)
        drafts = torch.empty((len(speculating), num_drafts), dtype=torch.long, device=first.device)  # [B, k]
        drafts[:, 0] = first
        for j in range(1, num_drafts):
            live = [b for b, s in enumerate(speculating) if s.num_lookahead_tokens > j]
            if len(live) == len(speculating):
                drafts[:, j] = self._decode(speculating, drafts[:, j - 1], j)
            else:
                index = host_to_device(live, drafts.device, torch.long)
                drafts[index, j] = self._decode([speculating[b] for b in live], drafts[index, j - 1], j)
        rows = drafts.tolist()  # the one read-back
        return {s.request.request_id: row[:s.num_lookahead_tokens] for s, row in zip(speculating, rows)}

    def _catch_up(self, sched: SchedulerOutput, speculating_ids: list[str]) -> Optional[torch.Tensor]:
        """The catch-up forward (every scheduled request); d_1 of each speculating request, in order.

        When every request decodes and has at most k + 1 tokens to catch up, each catches up
        exactly k + 1 (re-writing K/V it already had, the same values): a uniform batch that
        replays the draft's full graph of k + 1 tokens a request."""
        buf, q = self.compiled.inputs, self.k + 1
        buf.wait_for_upload()
        wanted = set(speculating_ids)
        spans = []  # (start, end) per request: end is where the target's known tokens end
        for s in sched.scheduled:
            end = s.start + s.num_new_tokens - s.num_lookahead_tokens
            spans.append((min(self._computed.get(s.request.request_id, s.start), s.start), end))
        if all(q >= end - start >= 1 and end >= q for start, end in spans):
            spans = [(end - q, end) for _, end in spans]
        query_lens, seq_lens, sample_rows = [], [], []
        num_tokens = 0
        buf.qsl_np[0] = 0
        for i, (s, (start, end)) in enumerate(zip(sched.scheduled, spans)):
            rid = s.request.request_id
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
        if out.greedy_ids is not None:  # a full graph computed every row's argmax
            return out.greedy_ids[rows]
        return self.loaded.model.compute_logits(out.hidden[rows]).argmax(dim=-1)

    def _decode(self, scheduled: list, token_ids: torch.Tensor, j: int) -> torch.Tensor:
        """Draft step j: token d_j of each request in (``token_ids``, on the device) at its position,
        the argmax of d_{j+1} out (on the device)."""
        buf, bs = self.compiled.inputs, self.block_size
        buf.wait_for_upload()  # the step before may not have read its inputs yet: nothing was read back
        positions = []
        for i, s in enumerate(scheduled):
            pos = s.request.num_tokens - 1 + j  # d_j follows the last known token
            buf.table_np[i, :len(s.block_ids)] = s.block_ids
            buf.pos_np[i] = pos
            buf.slot_np[i] = s.block_ids[pos // bs] * bs + pos % bs
            buf.seq_lens_np[i] = pos + 1
            positions.append(pos + 1)
        n = len(scheduled)
        buf.qsl_np[:n + 1] = np.arange(n + 1)
        out = self.compiled.run(ModelInputs(n, n, [1] * n, positions, device_input_ids=token_ids))
        if out.greedy_ids is not None:
            return out.greedy_ids[:n]
        return self.loaded.model.compute_logits(out.hidden[:n]).argmax(dim=-1)
