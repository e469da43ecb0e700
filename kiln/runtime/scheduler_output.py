"""SchedulerOutput: what one engine step runs, handed from the scheduler to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kiln.runtime.multimodal import ImageFeature
from kiln.runtime.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) of prompt + output."""

    request: Request
    num_new_tokens: int  # lookahead slots included
    block_ids: list[int]  # the request's whole block table after allocation, in order
    # Speculative decoding: slots after the known tokens for up to this many proposed tokens, which
    # the model runner's proposer fills (it may propose fewer); counted in num_new_tokens.
    num_lookahead_tokens: int = 0

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled after it."""
        return self.start + self.num_new_tokens - self.num_lookahead_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    # Execution order: decode requests (one new token, context > 0) first, then prefill chunks.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Set by Scheduler.schedule_ahead once the next step was scheduled while this one was in flight:
    # per scheduled request, whether its chunk samples (read before its num_computed_tokens moved).
    advanced: Optional[list[bool]] = None
    # The encoder cache (kiln.runtime.encoder_cache): entries to drop, then images whose vision
    # embeddings to compute, before this step's forward.
    freed_encoder_hashes: list[str] = field(default_factory=list)
    encoder_inputs: list[ImageFeature] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
