"""What a step costs to send to rank processes: only what changed since the last step.

A ``SchedulerOutput`` holds whole ``Request`` objects (prompt, every output token, sampling
params). Pickled for every rank at every step, that is O(batch x context) bytes: at 128 requests
of 450 tokens, about 0.27 MB and milliseconds of pickling on each side, per step. Instead the
engine side (``StepEncoder``) sends a request in full the first time a rank sees it, and after that
only the output tokens and blocks appended since; each rank (``RequestMirror``) keeps its own copy
of every live request and rebuilds the ``SchedulerOutput`` the model runner expects::

    engine: SchedulerOutput ─ StepEncoder.encode ─> StepDelta ─ pickled once ─> every rank
    rank:   StepDelta ─ RequestMirror.apply ─> SchedulerOutput (mirror Requests) ─> ModelRunner.execute

    a decode in steady state travels as (request_id, [new token], [new block or none], start, 1)

Rules kept here:
- A request travels in full when the rank has not seen it, after it was preempted (its blocks
  were freed and its cached tokens reset), or when its block table no longer extends what was sent.
- Appends only otherwise: output tokens and block ids of a running request only ever grow.
- ``StepEncoder.forget`` and ``RequestMirror.forget`` drop a finished request on both sides; the
  executor sends forgets to every rank, so mirrors do not grow with the number of requests served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kiln.lora_request import LoRARequest
from kiln.runtime.request import Request
from kiln.sampling_params import SamplingParams
from kiln.runtime.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass
class NewRequest:
    """A request the rank has not seen (or must forget what it saw): everything the runner reads."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()  # min_tokens masks them
    pooling: Optional[str] = None
    lora_request: Optional[LoRARequest] = None  # the adapter it runs with


# (request_id, output tokens appended, block ids appended, num_computed_tokens, num_new_tokens)
CachedRequest = tuple[str, list[int], list[int], int, int]


@dataclass
class StepDelta:
    """One step for the ranks: the scheduled requests in execution order, new or cached."""

    scheduled: list[NewRequest | CachedRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)


class StepEncoder:
    """Engine side: remembers how many output tokens and blocks every rank holds per request."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (num output tokens, num blocks)

    def encode(self, sched: SchedulerOutput) -> StepDelta:
        for rid in sched.preempted_ids:
            self._sent.pop(rid, None)
        delta = StepDelta(preempted_ids=list(sched.preempted_ids))
        for s in sched.scheduled:
            req, blocks = s.request, s.block_ids
            outputs = req.output_token_ids
            sent = self._sent.get(req.request_id)
            if sent is None or sent[1] > len(blocks):
                delta.scheduled.append(NewRequest(req.request_id, req.prompt_token_ids, list(outputs),
                                                  req.sampling_params, list(blocks), req.num_computed_tokens,
                                                  s.num_new_tokens, req.eos_token_ids, req.pooling,
                                                  req.lora_request))
            else:
                n_out, n_blocks = sent
                delta.scheduled.append((req.request_id, outputs[n_out:], blocks[n_blocks:],
                                        req.num_computed_tokens, s.num_new_tokens))
            self._sent[req.request_id] = (len(outputs), len(blocks))
        return delta

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sent.pop(rid, None)

    def __len__(self) -> int:
        return len(self._sent)


class RequestMirror:
    """Rank side: a copy of every live request, updated from each ``StepDelta``."""

    def __init__(self) -> None:
        self._requests: dict[str, tuple[Request, list[int]]] = {}  # request id -> (request, block ids)

    def apply(self, delta: StepDelta) -> SchedulerOutput:
        for rid in delta.preempted_ids:
            self._requests.pop(rid, None)
        scheduled = []
        for item in delta.scheduled:
            if isinstance(item, NewRequest):
                req = Request(item.request_id, list(item.prompt_token_ids), item.sampling_params,
                              eos_token_ids=tuple(item.eos_token_ids), output_token_ids=list(item.output_token_ids),
                              pooling=item.pooling, lora_request=item.lora_request)
                blocks = list(item.block_ids)
                self._requests[item.request_id] = (req, blocks)
                num_computed, num_new = item.num_computed_tokens, item.num_new_tokens
            else:
                rid, new_tokens, new_blocks, num_computed, num_new = item
                entry = self._requests.get(rid)
                if entry is None:
                    raise RuntimeError(f"step names request {rid!r}, which this rank never received in full")
                req, blocks = entry
                req.output_token_ids.extend(new_tokens)
                blocks.extend(new_blocks)
            req.num_computed_tokens = num_computed
            scheduled.append(ScheduledRequest(req, num_new, blocks))
        return SchedulerOutput(scheduled=scheduled, preempted_ids=list(delta.preempted_ids))

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

    def __len__(self) -> int:
        return len(self._requests)
