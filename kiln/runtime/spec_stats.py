"""Speculative decoding counters, summed over the engine's life: what ``/metrics`` and ``kiln
bench`` report (proposed and kept tokens, and how often each proposal position was kept)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int  # k: the most positions a proposal has
    num_drafts: int = 0  # verifications of a request that had proposed tokens
    num_draft_tokens: int = 0  # proposed tokens
    num_accepted_tokens: int = 0  # of those, kept
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: kept at position i

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def add(self, counts: dict[str, tuple[int, int]]) -> None:
        """One step's ``RunnerOutput.spec_counts``: per request (proposed, kept)."""
        for proposed, accepted in counts.values():
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            for i in range(accepted):
                self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": list(self.accepted_per_position)}
