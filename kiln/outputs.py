"""What the engine hands back: RequestOutput holding one CompletionOutput per sample, or, from
the engine-core process, RequestDelta holding what is new since the last one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import msgspec

# One entry per generated token: {token_id: logprob} for the sampled token and the top-N.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it
    logprobs: Optional[list[TokenLogprobs]] = None
    cumulative_logprob: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)
    # Set when kiln failed this request (a bug, logged with its traceback): it is finished, its
    # unfinished samples end with finish_reason "error", and the engine goes on with the others.
    error: Optional[str] = None
    # With SamplingParams.prompt_logprobs: per prompt token (None for the first) its logprob and the top-N.
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    embedding: Optional[list[float]] = None  # an embedding request's normalized vector


class SampleDelta(msgspec.Struct, array_like=True, gc=False):
    """What one sample added since its request's last delta (``cumulative_logprob``: the running total)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Union[None, str, int] = None
    logprobs: Optional[list[TokenLogprobs]] = None
    cumulative_logprob: Optional[float] = None


class RequestDelta(msgspec.Struct, array_like=True, gc=False):
    """One step's news of a request, as the engine-core process sends it (a msgspec struct: about
    ten times cheaper to build and encode than a ``RequestOutput``, once per running request per
    step). The prompt is the frontend's; prompt logprobs and the embedding come with the finish."""

    request_id: str
    outputs: list[SampleDelta]
    finished: bool = False
    num_cached_tokens: int = 0
    error: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    embedding: Optional[list[float]] = None
