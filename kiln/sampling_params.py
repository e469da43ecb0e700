"""SamplingParams: how one request is sampled and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

# Seeds are signed 64-bit integers (as OpenAI's API and vLLM take them); the generators accept them all.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class SamplingParams:
    """Per-request sampling options, validated on construction (ValueError says what to change)."""

    n: int = 1
    max_tokens: Optional[int] = 16  # None: up to the model's context length
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # number of top logprobs per generated token (0: only the sampled one)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.seed is None or (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX),
             f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (signed 64-bit), got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a non-empty string or a list of them"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
