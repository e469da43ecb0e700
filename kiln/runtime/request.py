"""Request: one sequence's state as the scheduler and KV cache see it.

A user prompt with ``n > 1`` becomes n requests (``<id>#<i>``) that share the prompt's blocks
through the prefix cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from kiln.lora_request import LoRARequest
from kiln.runtime.multimodal import ImageFeature
from kiln.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.value if self.finished else None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # the model's stop ids (ignored with ignore_eos)
    max_model_len: Optional[int] = None  # the context cap: prompt + output never pass it
    priority: int = 0  # lower runs first under the priority policy
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: Optional[object] = None
    # An embedding request: "last" or "mean" pooling of the prompt's final hidden states, normalized;
    # it runs its prefill only and ends without a token.
    pooling: Optional[str] = None
    # Scheduling ahead (``Scheduler.schedule_ahead``): the token of the step in flight, not yet
    # known, is held as a placeholder at the end of output_token_ids until update() writes it.
    num_output_placeholders: int = 0
    lora_request: Optional[LoRARequest] = None  # the adapter it runs with; None: the base model
    mm_features: tuple[ImageFeature, ...] = ()  # its images, in prompt order

    @property
    def lora_id(self) -> int:
        """The adapter's id (``LoRARequest.lora_int_id``), 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most output tokens this request may have."""
        cap = self.max_model_len or (1 << 62)
        if self.sampling_params.max_tokens is None:
            return cap
        return min(cap, self.num_prompt_tokens + self.sampling_params.max_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
