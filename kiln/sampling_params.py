"""SamplingParams: how one request is sampled and when it stops."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# Seeds are signed 64-bit integers (as OpenAI's API and vLLM take them); the generators accept them all.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``structured_outputs``); set exactly one field.

    ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON object; ``regex``:
    a regular expression; ``choice``: the output is one of these strings; ``grammar``: an EBNF
    grammar (GBNF, with a ``root`` rule).

    ``after_token_ids``: the constraint starts only after the output's first occurrence of these
    ids (a reasoning model's end-of-thinking marker), so the thinking before it is free; None:
    from the first token.
    """

    json: Union[None, str, dict] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    after_token_ids: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.after_token_ids is not None and (
                not self.after_token_ids or not all(isinstance(t, int) and t >= 0 for t in self.after_token_ids)):
            raise ValueError("structured_outputs.after_token_ids must be a non-empty list of token ids")
        if self.after_token_ids is not None:
            object.__setattr__(self, "after_token_ids", tuple(self.after_token_ids))
        set_fields = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        set_fields += ["json_object"] if self.json_object else []
        if len(set_fields) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                             f"got {set_fields or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.json is not None and isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar cache is keyed by; equal constraints share one grammar."""
        if self.json is not None:
            spec: Any = json.loads(self.json) if isinstance(self.json, str) else self.json
            return "json", json.dumps(spec)  # key order kept: it is the order the output follows
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar


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
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit, in [-100, 100]
    skip_special_tokens: bool = True  # in the output text
    prompt_logprobs: Optional[int] = None  # top logprobs per prompt token (0: only the prompt's own)
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
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
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0
             and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}"),
            (self.logit_bias is None or all(-100 <= v <= 100 and k >= 0 for k, v in self.logit_bias.items()),
             "logit_bias must map token ids >= 0 to values in [-100, 100]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def edits_logits(self) -> bool:
        """Whether logits are edited before sampling (logit bias, min_tokens, a grammar); such
        requests are sampled one token a step (speculative decoding skips them)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.structured_outputs is not None
