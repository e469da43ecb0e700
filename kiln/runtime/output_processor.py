"""OutputProcessor: turns new tokens into RequestOutputs (detokenize, stop strings, n > 1).

It owns one incremental detokenizer per sample and groups the n samples of a user request back
into one RequestOutput. Text that may still turn into a stop string is held back, so a streamed
delta never has to be taken back. Outputs are cumulative ``RequestOutput``s (each holds everything
so far), or with ``delta=True`` (the engine-core process) ``RequestDelta``s: only the new text,
token ids and logprobs, no prompt (the frontend keeps it), prompt logprobs and the embedding once,
with the finish. It reports which samples hit a stop string; the engine then
finishes them in the scheduler (which frees their blocks).

One request's failure stays its own: an exception while taking its token (detokenizer, stop
strings, logprobs) is logged, the request ends with ``error`` set and its samples are reported as
failed, for the engine to finish; the other requests of the step go on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Union

from kiln.outputs import CompletionOutput, RequestDelta, RequestOutput, SampleDelta
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.request import Request, RequestStatus

logger = logging.getLogger(__name__)

@dataclass
class _Sample:
    request: Request
    detokenizer: IncrementalDetokenizer
    index: int
    logprobs: Optional[list[dict[int, float]]] = None
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    num_taken: int = 0  # output tokens taken so far; a stop string can leave later ones untaken
    # What earlier delta outputs carried: tokens, characters of text, logprobs entries.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_sent_logprobs: int = 0

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            token_ids=self.request.output_token_ids[:self.num_taken],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )

    def delta(self) -> SampleDelta:
        """What is new since the last delta."""
        text = self.detokenizer.text
        out = SampleDelta(
            self.index, text[self.num_sent_chars:], self.request.output_token_ids[self.num_sent_tokens:self.num_taken],
            self.finish_reason, self.stop_reason,
            self.logprobs[self.num_sent_logprobs:] if self.logprobs is not None else None,
            self.cumulative_logprob if self.logprobs is not None else None,
        )
        self.num_sent_chars, self.num_sent_tokens = len(text), self.num_taken
        self.num_sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        return out


@dataclass
class _UserRequest:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: list[_Sample] = field(default_factory=list)
    error: Optional[str] = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token (the first None), by position,
    # so a chunk recomputed after preemption overwrites instead of repeating.
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    embedding: Optional[list[float]] = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.samples],
            finished=self.finished,
            num_cached_tokens=self.samples[0].request.num_cached_tokens,
            error=self.error,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            embedding=self.embedding,
        )

    def delta(self) -> RequestDelta:
        finished = self.finished
        return RequestDelta(
            self.request_id, [s.delta() for s in self.samples], finished,
            self.samples[0].request.num_cached_tokens, self.error,
            list(self.prompt_logprobs) if finished and self.prompt_logprobs is not None else None,
            self.embedding if finished else None,
        )


def _ended_by_stop_token(req: Request, token: int) -> bool:
    return req.status == RequestStatus.FINISHED_STOPPED and token in req.sampling_params.stop_token_ids


class OutputProcessor:
    def __init__(self, tokenizer, delta: bool = False):
        """``delta``: each output holds only what is new since the request's last one."""
        self.tokenizer = tokenizer
        self.delta = delta
        self._users: dict[str, _UserRequest] = {}
        self._samples: dict[str, tuple[_UserRequest, _Sample]] = {}

    def add(self, request_id: str, prompt: Optional[str], samples: list[Request]) -> None:
        """Track a user request's samples; all or nothing (a failure leaves nothing behind)."""
        user = _UserRequest(request_id, prompt, samples[0].prompt_token_ids)
        if samples[0].sampling_params.prompt_logprobs is not None:
            user.prompt_logprobs = [None] * len(user.prompt_token_ids)
        for i, req in enumerate(samples):
            params = req.sampling_params
            sample = _Sample(req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params,
                                                             params.skip_special_tokens), i)
            if params.logprobs is not None:
                sample.logprobs = []
            user.samples.append(sample)
        for sample in user.samples:
            self._samples[sample.request.request_id] = (user, sample)
        self._users[request_id] = user

    def add_prompt_logprobs(self, found: dict[str, list[tuple[int, dict[int, float]]]]) -> None:
        """Prompt logprobs a step computed (any sample of a user request may carry them)."""
        for sample_id, entries in found.items():
            user = self._samples.get(sample_id, (None, None))[0]
            if user is None or user.prompt_logprobs is None:
                continue
            for position, entry in entries:
                user.prompt_logprobs[position] = entry

    def add_embeddings(self, found: dict[str, list[float]]) -> None:
        for sample_id, vector in found.items():
            user = self._samples.get(sample_id, (None, None))[0]
            if user is not None:
                user.embedding = vector

    def has(self, request_id: str) -> bool:
        return request_id in self._users

    def sample_ids(self, request_id: str) -> list[str]:
        user = self._users.get(request_id)
        return [s.request.request_id for s in user.samples] if user else []

    def process(
        self, updated: list[Request], logprobs: dict[str, Optional[dict[int, float]]], finished_only: bool = False
    ) -> tuple[list[Union[RequestOutput, RequestDelta]], list[str], list[str]]:
        """Take this step's new tokens; return outputs, the sample ids that hit a stop string and
        the sample ids of requests that failed (each failed request's output has ``error`` set).
        ``finished_only``: outputs of finished requests only (a caller that reads nothing else
        saves building an output per running request per step)."""
        touched: dict[str, _UserRequest] = {}
        stopped: list[str] = []
        failed: list[str] = []
        for req in updated:
            entry = self._samples.get(req.request_id)
            if entry is None:
                continue
            user, sample = entry
            touched[user.request_id] = user
            if user.error is not None:
                continue  # another sample of it failed earlier in this step
            try:
                if self._take_token(req, sample, logprobs.get(req.request_id)):
                    stopped.append(req.request_id)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                logger.exception("request %s failed while its output was processed", user.request_id)
                failed += self._fail(user, e)
        if finished_only:
            return [self._emit(u) for u in touched.values() if u.finished], stopped, failed
        return [self._emit(u) for u in touched.values()], stopped, failed

    def _take_token(self, req: Request, sample: _Sample, lp: Optional[dict[int, float]] | list) -> bool:
        """Detokenize one sample's new tokens (several after a speculative step, with one logprobs
        entry each); True when it hit a stop string. Tokens after a stop string are not taken."""
        if req.pooling is not None:  # an embedding ends with its prompt, without a token
            sample.finish_reason = req.status.finish_reason
            return False
        new_tokens = req.output_token_ids[sample.num_taken:]
        lps = lp if isinstance(lp, list) else [None] * (len(new_tokens) - 1) + [lp]
        for i, token in enumerate(new_tokens):
            last = i == len(new_tokens) - 1
            if not (last and _ended_by_stop_token(req, token)):  # like eos, a stop token's text is not output
                sample.detokenizer.add(token)
            if sample.logprobs is not None and lps[i] is not None:
                sample.logprobs.append(lps[i])
                sample.cumulative_logprob += lps[i].get(token, 0.0)
            sample.num_taken += 1
            if sample.detokenizer.stop_string is not None:
                break
        hit_stop = sample.detokenizer.stop_string is not None and not req.is_finished
        if hit_stop:
            sample.finish_reason, sample.stop_reason = "stop", sample.detokenizer.stop_string
        elif req.is_finished:
            sample.finish_reason = req.status.finish_reason
            sample.stop_reason = sample.detokenizer.stop_string or req.stop_reason
            if sample.detokenizer.stop_string is not None:
                sample.finish_reason = "stop"
        if sample.finish_reason is not None:
            sample.detokenizer.flush()
        return hit_stop

    def _fail(self, user: _UserRequest, error: Exception) -> list[str]:
        """End every unfinished sample of ``user`` with "error"; return all its sample ids (the
        scheduler ignores those already finished)."""
        user.error = f"{type(error).__name__}: {error}"
        for s in user.samples:
            if s.finish_reason is None:
                s.finish_reason = "error"
        return [s.request.request_id for s in user.samples]

    def abort(self, request_id: str) -> Optional[Union[RequestOutput, RequestDelta]]:
        user = self._users.get(request_id)
        if user is None:
            return None
        for s in user.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        return self._emit(user)

    def _emit(self, user: _UserRequest) -> Union[RequestOutput, RequestDelta]:
        out = user.delta() if self.delta else user.output()
        if out.finished:
            self._users.pop(user.request_id, None)
            for s in user.samples:
                self._samples.pop(s.request.request_id, None)
        return out

    @property
    def num_unfinished(self) -> int:
        return len(self._users)
