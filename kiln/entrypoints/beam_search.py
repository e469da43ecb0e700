"""Beam search and best_of, run by the frontends (``LLM`` and the server) over the plain engine.

Each step sends every running beam to the engine as a request of its own: the prompt and the
beam's tokens so far, one greedy token, the top-K logprobs. The frontend keeps the best beams, so
the scheduler and the model runner know nothing of beams. Beams share KV blocks through the prefix
cache: a step's requests find the full blocks of the prompt and of their common prefix cached by
the step before, and only each beam's last, partial block is computed again.

The search is transformers' ``generate(num_beams=B, do_sample=False)`` step for step:
- candidates: the K = max(2, 1 + number of stop ids) * B continuations with the highest sum of
  logprobs over all running beams (only a beam's own top K tokens can be among them, so K
  logprobs per beam suffice);
- the best B candidates that do not stop run on; a candidate among the first B that stops (a
  stop id, or the length cap) is a finished beam scored ``sum / (generated tokens ** length_penalty)``,
  the best B of them kept;
- the search ends at the length cap, or when ``early_stopping`` says no running beam can beat the
  finished ones any more (False: at its current length; True: once B beams finished; "never":
  at the longest length, when length_penalty > 0).

``best_of`` > n without beam search draws best_of samples and keeps the n with the highest
cumulative logprob (``best_of_params``, ``keep_best``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import BeamSearchParams, SamplingParams

MAX_STEP_LOGPROBS = 20  # what one engine request returns (SamplingParams.logprobs)


@dataclass
class BeamSearchSequence:
    """One finished beam (vLLM's shape): ``tokens`` the prompt's and the generated ids, ``text``
    all of them decoded (special tokens skipped), ``logprobs`` per generated token that step's top
    logprobs, ``cum_logprob`` their sum, ``score`` the length-penalized score it was ranked by."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float
    score: float
    num_prompt_tokens: int
    finish_reason: str  # "stop" (a stop id, the last token) | "length"
    text: Optional[str] = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (``beam_width`` of them)."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    token_ids: list[int] = field(default_factory=list)  # generated
    logprobs: list[dict[int, float]] = field(default_factory=list)
    sum_logprob: float = 0.0


class BeamSearch:
    """One prompt's search: ``step_prompts()`` are the requests of the next step (one per running
    beam, with ``step_params``), ``advance`` takes their logprobs, until ``done``."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 max_model_len: int, stop_token_ids: Sequence[int] = (), num_logprobs: Optional[int] = None):
        """``eos_token_ids``: the model's (ignored with ``params.ignore_eos``); ``stop_token_ids``
        end a beam too; ``num_logprobs``: top logprobs kept per output token (None: none)."""
        num_prompt = len(prompt_token_ids)
        if params.max_tokens is not None and num_prompt + params.max_tokens > max_model_len:
            raise ValueError(f"prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {max_model_len} tokens; lower max_tokens to at most "
                             f"{max_model_len - num_prompt}")
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = params.max_tokens or max(1, max_model_len - num_prompt)
        self.stop_ids = frozenset(() if params.ignore_eos else eos_token_ids) | frozenset(stop_token_ids)
        self.user_stop_ids = frozenset(stop_token_ids)
        self.num_logprobs = num_logprobs
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * params.beam_width
        # min_tokens drops stop ids from the first steps' candidates: ask for as many more.
        wanted = self.num_candidates + (len(self.stop_ids) if params.min_tokens else 0)
        self.num_step_logprobs = max(wanted, num_logprobs or 0)
        if self.num_step_logprobs > MAX_STEP_LOGPROBS:
            per_beam = max(2, 1 + len(self.stop_ids))
            raise ValueError(f"beam_width={params.beam_width} needs the top {self.num_step_logprobs} logprobs of each "
                             f"beam per step, more than the engine's {MAX_STEP_LOGPROBS}; use a beam width of at most "
                             f"{(MAX_STEP_LOGPROBS - (len(self.stop_ids) if params.min_tokens else 0)) // per_beam}")
        self.running = [_Beam()]
        self.finished: list[tuple[float, _Beam]] = []  # (score, beam), best first, at most beam_width
        self.improvable = True  # transformers' early-stop heuristic: a running beam may still beat them
        self.done = False

    def step_params(self) -> SamplingParams:
        # ignore_eos: the frontend decides what stops a beam; the engine only scores the next token.
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.num_step_logprobs, ignore_eos=True)

    def step_prompts(self) -> list[list[int]]:
        return [self.prompt_token_ids + beam.token_ids for beam in self.running]

    def advance(self, entries: list[dict[int, float]]) -> None:
        """Take the next token's top logprobs of each running beam (in ``running``'s order)."""
        width, num_generated = self.params.beam_width, len(self.running[0].token_ids) + 1
        candidates = []
        for beam, entry in zip(self.running, entries, strict=True):
            for token, logprob in entry.items():
                if token in self.stop_ids and num_generated <= self.params.min_tokens:
                    continue
                candidates.append((beam.sum_logprob + logprob, beam, token, entry))
        candidates.sort(key=lambda c: c[0], reverse=True)  # stable: ties keep beam, then logprob order
        at_cap = num_generated >= self.max_tokens
        running, stopped = [], []
        for rank, (total, beam, token, entry) in enumerate(candidates[:self.num_candidates]):
            grown = _Beam(beam.token_ids + [token], beam.logprobs + [entry], total)
            if not (at_cap or token in self.stop_ids):
                if len(running) < width:
                    running.append(grown)
            elif rank < width:  # only the first B candidates may finish; the rest are spares
                stopped.append(grown)
        was_full = len(self.finished) >= width
        if self.improvable and not (was_full and self.params.early_stopping is True):
            scored = [(b.sum_logprob / num_generated ** self.params.length_penalty, b) for b in stopped]
            self.finished = sorted(self.finished + scored, key=lambda f: f[0], reverse=True)[:width]
        self.running = running
        full = len(self.finished) >= width
        if self.improvable and full and running:
            self.improvable = self._best_possible(running[0], num_generated) > self.finished[-1][0]
        self.done = at_cap or not running or not self.improvable or (full and self.params.early_stopping is True)

    def _best_possible(self, best_running: _Beam, num_generated: int) -> float:
        """The score transformers assumes the best running beam can still reach."""
        penalty = self.params.length_penalty
        length = self.max_tokens if self.params.early_stopping == "never" and penalty > 0 else num_generated
        return best_running.sum_logprob / length ** penalty

    def results(self, tokenizer) -> list[BeamSearchSequence]:
        """The best ``beam_width`` beams, best first, each decoded (``tokenizer``: None leaves text unset)."""
        ranked = list(self.finished)
        if len(ranked) < self.params.beam_width:  # ended early without enough finished: the running ones count
            num = max(1, len(self.running[0].token_ids)) if self.running else 1
            ranked += [(b.sum_logprob / num ** self.params.length_penalty, b) for b in self.running]
            ranked = sorted(ranked, key=lambda f: f[0], reverse=True)[:self.params.beam_width]
        out = []
        for score, beam in ranked:
            stopped = bool(beam.token_ids) and beam.token_ids[-1] in self.stop_ids
            tokens = self.prompt_token_ids + beam.token_ids
            out.append(BeamSearchSequence(
                tokens=tokens, logprobs=beam.logprobs, cum_logprob=beam.sum_logprob, score=score,
                num_prompt_tokens=len(self.prompt_token_ids), finish_reason="stop" if stopped else "length",
                text=tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None))
        return out

    def completion_outputs(self, n: int, tokenizer, skip_special_tokens: bool = True) -> list[CompletionOutput]:
        """The best ``n`` beams as a request's samples (text without the stop id that ended a beam)."""
        outs = []
        for i, seq in enumerate(self.results(None)[:n]):
            ids = seq.output_token_ids
            shown = ids[:-1] if seq.finish_reason == "stop" else ids
            text = tokenizer.decode(shown, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""
            stop_reason = ids[-1] if seq.finish_reason == "stop" and ids[-1] in self.user_stop_ids else None
            logprobs = None
            if self.num_logprobs is not None:
                logprobs = [_top(entry, token, self.num_logprobs) for token, entry in zip(ids, seq.logprobs)]
            outs.append(CompletionOutput(index=i, text=text, token_ids=ids, finish_reason=seq.finish_reason,
                                         stop_reason=stop_reason, logprobs=logprobs, cumulative_logprob=seq.cum_logprob))
        return outs


def _top(entry: dict[int, float], token: int, num: int) -> dict[int, float]:
    """The chosen token's logprob and the step's top ``num``, as a sampled token's entry reads."""
    top = dict(sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num])
    top[token] = entry[token]
    return top


def beam_search_params(params: SamplingParams) -> BeamSearchParams:
    """A ``SamplingParams(use_beam_search=True)``'s search."""
    return BeamSearchParams(beam_width=params.beam_width, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                            length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                            min_tokens=params.min_tokens)


def new_search(prompt_token_ids: list[int], params: SamplingParams, eos_token_ids: Sequence[int],
               max_model_len: int) -> BeamSearch:
    """The search a ``SamplingParams(use_beam_search=True)`` asks for one prompt."""
    return BeamSearch(prompt_token_ids, beam_search_params(params), eos_token_ids, max_model_len,
                      params.stop_token_ids, params.logprobs)


def ranks_outputs(params: SamplingParams) -> bool:
    """Whether the frontend runs this request as a beam search or a best_of ranking."""
    return params.use_beam_search or params.beam_width != params.n


def best_of_params(params: SamplingParams) -> SamplingParams:
    """The engine request of a sampled best_of > n: best_of samples with their cumulative logprob."""
    return dataclasses.replace(params, n=params.beam_width, best_of=None,
                               logprobs=params.logprobs if params.logprobs is not None else 0)


def keep_best(out: RequestOutput, params: SamplingParams) -> RequestOutput:
    """``out`` of ``best_of_params(params)`` cut to the ``params.n`` samples of highest cumulative logprob."""
    ranked = sorted(out.outputs, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[:params.n]
    keep_logprobs = params.logprobs is not None
    outputs = [dataclasses.replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None)
               for i, c in enumerate(ranked)]
    return dataclasses.replace(out, outputs=outputs)


def search_output(search: BeamSearch, request_id: str, prompt: Optional[str], params: SamplingParams, tokenizer,
                  num_cached_tokens: int = 0) -> RequestOutput:
    """A finished search as the ``RequestOutput`` of a ``SamplingParams(use_beam_search=True)`` request."""
    return RequestOutput(request_id, prompt, search.prompt_token_ids,
                         search.completion_outputs(params.n, tokenizer, params.skip_special_tokens),
                         finished=True, num_cached_tokens=num_cached_tokens)
