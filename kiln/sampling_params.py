"""SamplingParams: how one request is sampled and when it stops."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# Seeds are signed 64-bit integers (as OpenAI's API and vLLM take them); the generators accept them all.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
# |length_penalty| bound: a score divides by length ** length_penalty, which stays a finite float
# for every length a model's context allows.
MAX_LENGTH_PENALTY = 10.0
EARLY_STOPPING = (False, True, "never")  # transformers' values


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
    # best_of > n: best_of samples, the n with the highest cumulative logprob returned. With
    # use_beam_search: a beam search of width best_of (else n) returning its n best beams
    # (kiln.entrypoints.beam_search), scored with length_penalty and stopped by early_stopping as
    # transformers' ``generate(num_beams=...)``. Both run in LLM.generate and the server, not the engine.
    best_of: Optional[int] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False

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
        self._check_ranking()

    def _check_ranking(self) -> None:
        """best_of, use_beam_search, length_penalty and early_stopping, and what beam search refuses."""
        if self.best_of is not None and not (isinstance(self.best_of, int) and self.best_of >= self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        _check_beam_scoring(self.length_penalty, self.early_stopping)
        if not self.use_beam_search:
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                raise ValueError("length_penalty and early_stopping score beams: set use_beam_search=True, "
                                 "or leave them at 1.0 and False")
            return
        refused = [name for name, on in (
            ("temperature", self.temperature != 0.0), ("top_p", self.top_p != 1.0), ("top_k", self.top_k != 0),
            ("min_p", self.min_p != 0.0), ("presence_penalty", self.presence_penalty != 0.0),
            ("frequency_penalty", self.frequency_penalty != 0.0), ("repetition_penalty", self.repetition_penalty != 1.0),
            ("logit_bias", bool(self.logit_bias)), ("stop", bool(self.stop)),
            ("prompt_logprobs", self.prompt_logprobs is not None),
            ("structured_outputs", self.structured_outputs is not None)) if on]
        if refused:
            raise ValueError(f"use_beam_search: beam search keeps the most likely beams by their raw logprobs and "
                             f"samples nothing, so it cannot apply {', '.join(refused)}; set temperature=0 and leave "
                             "top_p, top_k, min_p, the penalties, logit_bias, stop, prompt_logprobs and "
                             "structured_outputs unset")

    @property
    def beam_width(self) -> int:
        """The beams kept per step (use_beam_search), or the samples drawn: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def edits_logits(self) -> bool:
        """Whether logits are edited before sampling (logit bias, min_tokens, a grammar); such
        requests are sampled one token a step (speculative decoding skips them)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.structured_outputs is not None


def _check_beam_scoring(length_penalty: float, early_stopping: Union[bool, str]) -> None:
    if not (isinstance(length_penalty, (int, float)) and abs(length_penalty) <= MAX_LENGTH_PENALTY):
        raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                         f"got {length_penalty!r}")
    if not any(early_stopping is v for v in EARLY_STOPPING):
        raise ValueError(f"early_stopping must be true, false or \"never\", got {early_stopping!r}")


@dataclass(frozen=True)
class BeamSearchParams:
    """``LLM.beam_search``'s options (vLLM's names): ``beam_width`` beams kept per step, up to
    ``max_tokens`` generated tokens each (None: up to the context). A finished beam scores
    ``sum of logprobs / (generated tokens ** length_penalty)``; ``early_stopping`` (transformers'
    meaning: False stops once no running beam can beat the finished ones at its current length,
    True as soon as ``beam_width`` beams finished, "never" only when none can ever beat them).
    ``min_tokens``: EOS cannot end a beam before this many tokens. ``temperature`` must be 0 (the
    search is deterministic); ``include_stop_str_in_output`` is accepted for vLLM's callers and
    changes nothing (beam search takes no stop strings)."""

    beam_width: int
    max_tokens: Optional[int]
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: Union[bool, str] = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.beam_width, int) and self.beam_width >= 1):
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.max_tokens is not None and not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0: beam search keeps the most likely beams, it samples none "
                             f"(got {self.temperature})")
        if not (isinstance(self.min_tokens, int) and self.min_tokens >= 0
                and (self.max_tokens is None or self.min_tokens <= self.max_tokens)):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        _check_beam_scoring(self.length_penalty, self.early_stopping)
