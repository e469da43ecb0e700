"""Scheduler: which requests run each step, and how many tokens each computes.

Owns the waiting queue, the running list and request lifecycles; the blocks belong to
KVCacheManager. One step is: serve running requests, admit waiting ones, hand a SchedulerOutput to
the model runner, then update() with the sampled tokens.

Rules kept here:
- A step computes at most max_num_batched_tokens tokens; at most max_num_seqs requests run.
- Running requests (decodes and unfinished prefill chunks) are served first, in admission order,
  so a long prompt never starves a decode. Then waiting requests are admitted in queue order
  (FCFS, or (priority, arrival) under "priority"); the first that does not fit stops admission.
- With chunked prefill a prompt is cut to the budget left; without it a prompt runs whole or
  waits (a resumed request longer than the whole budget is still cut, else it could never run).
- Out of blocks, a running request is preempted by recompute: the tail of the running list (FCFS)
  or the lowest-priority, latest-arrived one (priority) loses its blocks and goes back to the
  waiting queue (FCFS: to its front; priority: to its place by key) with its output kept, so it
  resumes where it left off. The victim may already be scheduled in this step: it then leaves the
  step's output and gives its tokens back to the budget. A step that preempted admits nothing new.
- schedule() never advances num_computed_tokens: ScheduledRequest.start reads it until update().
- Scheduling ahead (``schedule_ahead``): the next step is scheduled while one is in flight. The
  step in flight is advanced first, as update() would move it, with a placeholder for each token
  it samples (``PLACEHOLDER_TOKEN``; the model runner feeds the real one from the device); its
  update() then writes the tokens in and checks them for a stop. A request that finishes by length
  with the step in flight is not scheduled again; one stopped by a token (eos, stop ids) holds a
  wasted row in the step scheduled ahead, as a stop string does. A request preempted while its
  step is in flight still receives that step's token. No block is hashed over a placeholder.
- LoRA: the running requests use at most ``max_loras`` distinct adapters (the model runner's
  device slots; the base model takes none), so every step's adapters fit the slots at once. A
  waiting request whose adapter would be one more waits at the head of the queue until a running
  request of another adapter finishes.
- update() also ends a request (FINISHED_LENGTH) once it holds as many tokens as the whole pool
  can (plus the last sampled one), so a request alone always fits and never preempts itself.
- Speculative decoding: while at most ``speculative.max_batch_size`` requests run, a decoding
  request gets up to k lookahead slots (budgeted and allocated like tokens, never past max_tokens
  or the pool); update() takes the tokens the runner kept (several per request), stops at the
  first that finishes the request (the rest are dropped), and gives back the blocks that only
  rejected tokens used.
- Images (``kiln.runtime.encoder_cache``): a chunk that reaches an image's tokens needs its
  embeddings, in the encoder cache already or computed this step within the step's encoder budget
  and the cache's free tokens; otherwise the chunk stops before the image (chunked prefill may
  still cut inside an image whose embeddings are there). A request holds an image's entry until its
  tokens are all computed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from kiln.config import SchedulerConfig, SpeculativeConfig
from kiln.runtime.encoder_cache import EncoderCacheManager
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.multimodal import features_overlapping
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.scheduler_output import ScheduledRequest, SchedulerOutput


PLACEHOLDER_TOKEN = -1  # an output token sampled in a step still in flight (schedule_ahead)
MIN_ENCODER_TOKENS = 8192  # the encoder cache and its per-step budget hold at least this many embeddings


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


def _is_decode(scheduled: ScheduledRequest) -> bool:
    return scheduled.num_new_tokens == 1 and scheduled.request.num_computed_tokens > 0


def _as_list(tokens: int | list[int]) -> list[int]:
    return [tokens] if isinstance(tokens, int) else tokens


@dataclass
class _Step:
    """The step being built: what is scheduled so far and the token budget left."""

    token_budget: int
    encoder_budget: int = 0  # new image embedding tokens this step may still compute
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted_ids: list[str] = field(default_factory=list)

    def add(self, request: Request, num_new_tokens: int, block_ids: list[int], num_lookahead_tokens: int = 0) -> None:
        self.scheduled[request.request_id] = ScheduledRequest(request, num_new_tokens + num_lookahead_tokens,
                                                              block_ids, num_lookahead_tokens)
        self.token_budget -= num_new_tokens + num_lookahead_tokens

    def preempt(self, request: Request) -> None:
        self.preempted_ids.append(request.request_id)
        dropped = self.scheduled.pop(request.request_id, None)
        if dropped is not None:
            self.token_budget += dropped.num_new_tokens

    def to_output(self) -> SchedulerOutput:
        decodes, prefills = [], []
        for s in self.scheduled.values():  # one pass: this runs for every request every step
            (decodes if _is_decode(s) else prefills).append(s)
        return SchedulerOutput(scheduled=decodes + prefills, preempted_ids=list(self.preempted_ids))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 speculative: SpeculativeConfig = SpeculativeConfig(), max_loras: int = 0,
                 encoder_cache: Optional[EncoderCacheManager] = None) -> None:
        """``encoder_cache``: image embeddings' bookkeeping; default a cache and a per-step budget of
        ``max(max_num_batched_tokens, MIN_ENCODER_TOKENS)`` embedding tokens each (a step's chunk may
        cover only part of an image, but its whole image is encoded)."""
        if not config.is_resolved:
            raise ValueError("the scheduler needs max_num_seqs and max_num_batched_tokens: resolve the config "
                             "for its device first (kiln.config.resolve_for_device)")
        self.config = config
        self.kv_manager = kv_manager
        self.speculative = speculative
        self.max_loras = max_loras  # distinct adapters running at once (LoRA's device slots)
        encoder_tokens = max(config.max_num_batched_tokens, MIN_ENCODER_TOKENS)
        self.encoder_cache = encoder_cache or EncoderCacheManager(encoder_tokens, encoder_tokens)
        self.waiting: list[Request] = []  # queue order, head first
        self.running: list[Request] = []  # admission order
        self._requests: dict[str, Request] = {}  # unfinished requests only
        self.num_preemptions = 0  # since start, all requests together
        # The last sampled token is never written to the cache, so a request alone in the pool can
        # hold one token more than the pool has slots.
        self.max_num_tokens_in_pool = kv_manager.num_usable_blocks * kv_manager.block_size + 1

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Optional[Request]:
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (saying what to change) when it could never run."""
        self._check_can_run(request)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._enqueue_waiting(request, front=False)

    def schedule(self) -> SchedulerOutput:
        step = _Step(token_budget=self.config.max_num_batched_tokens, encoder_budget=self.encoder_cache.budget)
        self._schedule_running(step)
        if not step.preempted_ids:
            # Blocks just ran out: a new request now would only be preempted again next step.
            self._schedule_waiting(step)
        out = step.to_output()
        if not out.is_empty:  # an empty step is never run: its frees wait for the next one
            out.encoder_inputs, out.freed_encoder_hashes = self.encoder_cache.take_step()
        return out

    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput:
        """The step after ``in_flight``, scheduled before its tokens are known (module rules).
        Every request of ``in_flight`` must sample one token at most (no lookahead slots) and have
        no placeholder yet; ``update(in_flight, ...)`` then fills the placeholders in."""
        for s in in_flight.scheduled:  # checked before anything moves
            if s.request.status is RequestStatus.RUNNING and (s.num_lookahead_tokens
                                                               or s.request.num_output_placeholders):
                raise ValueError(f"request {s.request.request_id}: cannot schedule ahead of a step with "
                                 "lookahead slots or a token still unknown")
        flags = []
        for s in in_flight.scheduled:
            request = s.request
            samples = s.samples  # read before num_computed_tokens moves
            flags.append(samples)
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += s.num_new_tokens
            if request.mm_features:
                self._release_computed_images(request)
            if samples and request.pooling is None:
                request.output_token_ids.append(PLACEHOLDER_TOKEN)
                request.num_output_placeholders = 1
        in_flight.advanced = flags
        return self.schedule()

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, int | list[int]]) -> list[Request]:
        """Advance each scheduled request past its chunk and append sampled tokens.

        A request's entry is one token, or a list of them (speculative decoding: the proposed
        tokens kept, then one more; each but the last was computed in this step). Returns the
        requests that received tokens this step, finished ones included. A request finished since
        ``schedule()`` (an abort, or a stop string found while the step was in flight) is skipped:
        its tokens are dropped and it is not returned.
        """
        if output.advanced is not None:
            return self._update_advanced(output, sampled_token_ids)
        received = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.status is not RequestStatus.RUNNING:
                continue  # finished after schedule() (abort, stop string while in flight): token dropped
            samples = scheduled.samples  # read before num_computed_tokens moves
            request.num_computed_tokens += scheduled.num_new_tokens - scheduled.num_lookahead_tokens
            if request.mm_features:
                self._release_computed_images(request)
            if not samples:
                continue
            if request.pooling is not None:  # an embedding: its prompt is done, the runner pooled it
                received.append(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                continue
            if request.request_id not in sampled_token_ids:
                raise ValueError(f"request {request.request_id} reached its last token but has no sampled token")
            received.append(request)
            for i, token_id in enumerate(_as_list(sampled_token_ids[request.request_id])):
                if i > 0:
                    request.num_computed_tokens += 1  # the kept proposed token before it was computed
                request.output_token_ids.append(token_id)
                status = self._stop_status(request, token_id)
                if status is not None:
                    self._finish(request, status)
                    break
            if scheduled.num_lookahead_tokens and request.status is RequestStatus.RUNNING:
                self.kv_manager.trim(request)
        return received

    def _update_advanced(self, output: SchedulerOutput, sampled_token_ids: dict[str, int | list[int]]
                         ) -> list[Request]:
        """update() of a step that schedule_ahead advanced already: its placeholders take their tokens."""
        received = []
        for scheduled, samples in zip(output.scheduled, output.advanced):
            request = scheduled.request
            if not request.num_output_placeholders:
                if samples and request.pooling is not None and request.status is RequestStatus.RUNNING:
                    received.append(request)  # an embedding: its prompt is done, the runner pooled it
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                continue
            request.num_output_placeholders = 0
            if request.status.finished:  # finished while in flight (abort, stop string): token dropped
                request.output_token_ids.pop()
                continue
            if request.request_id not in sampled_token_ids:
                raise ValueError(f"request {request.request_id} reached its last token but has no sampled token")
            token_id = _as_list(sampled_token_ids[request.request_id])[0]
            request.output_token_ids[-1] = token_id
            received.append(request)
            status = self._stop_status(request, token_id)
            if status is not None:
                self._finish(request, status)  # a request preempted meanwhile leaves the waiting queue
        return received

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request from outside (stop string, abort); unknown or finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, status)

    # -- phases of schedule() --

    def _schedule_running(self, step: _Step) -> None:
        for request in list(self.running):  # a copy: preemption removes from self.running
            if step.token_budget == 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if request.num_output_placeholders and request.num_tokens >= min(request.max_num_tokens,
                                                                              self.max_num_tokens_in_pool):
                continue  # its token in flight ends it by length (schedule_ahead)
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, step.token_budget)
            if request.mm_features:
                num_new_tokens = self._fit_images(request, request.num_computed_tokens, num_new_tokens, step)
            if num_new_tokens == 0:
                continue
            lookahead = self._num_lookahead_tokens(request, num_new_tokens, step.token_budget)
            block_ids = None
            if lookahead:  # lookahead slots never preempt anyone: without room, no speculation
                block_ids = self.kv_manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=lookahead)
                lookahead = lookahead if block_ids is not None else 0
            if block_ids is None:
                block_ids = self._allocate_or_preempt(request, num_new_tokens, step)
            if block_ids is not None:
                self._hold_images(request, request.num_computed_tokens, num_new_tokens, step)
                step.add(request, num_new_tokens, block_ids, lookahead)

    def _schedule_waiting(self, step: _Step) -> None:
        while self.waiting and step.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            if not self._admit(self.waiting[0], step):
                return  # no overtaking: later requests wait behind the head

    def _admit(self, request: Request, step: _Step) -> bool:
        if request.lora_id and not self._lora_fits(request.lora_id):
            return False
        computed_blocks, num_computed_tokens = self.kv_manager.get_computed_blocks(request)
        num_new_tokens = self._num_new_tokens(request, num_computed_tokens, step.token_budget)
        if request.mm_features:
            num_new_tokens = self._fit_images(request, num_computed_tokens, num_new_tokens, step)
        if num_new_tokens == 0:
            return False
        block_ids = self.kv_manager.allocate_slots(request, num_new_tokens, computed_blocks)
        if block_ids is None:
            return False
        self._hold_images(request, num_computed_tokens, num_new_tokens, step)
        self.waiting.pop(0)
        if request.status is RequestStatus.WAITING:  # first admission; a resumed request keeps its count
            request.num_cached_tokens = num_computed_tokens
        request.num_computed_tokens = num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        step.add(request, num_new_tokens, block_ids)
        return True

    def _fit_images(self, request: Request, start: int, num_new_tokens: int, step: _Step) -> int:
        """``num_new_tokens`` cut before the first image of the chunk whose embeddings are neither
        cached nor computable this step (0: the request waits; so does a cut without chunked prefill)."""
        cache, budget, free, counted = self.encoder_cache, step.encoder_budget, self.encoder_cache.num_free, set()
        for f in features_overlapping(request.mm_features, start, start + num_new_tokens):
            if cache.has(f.mm_hash) or f.mm_hash in counted:
                continue
            if f.length > min(budget, free):
                cut = f.offset - start if f.offset > start else 0
                return cut if cut and self.config.enable_chunked_prefill else 0
            budget, free = budget - f.length, free - f.length
            counted.add(f.mm_hash)
        return num_new_tokens

    def _hold_images(self, request: Request, start: int, num_new_tokens: int, step: _Step) -> None:
        """The request holds the encoder-cache entries of the images its scheduled chunk reaches."""
        cache = self.encoder_cache
        for f in features_overlapping(request.mm_features, start, start + num_new_tokens):
            if not cache.has(f.mm_hash):
                step.encoder_budget -= f.length
            cache.hold(request.request_id, f)

    def _release_computed_images(self, request: Request) -> None:
        for f in request.mm_features:
            if f.end <= request.num_computed_tokens and self.encoder_cache.holds(request.request_id, f.mm_hash):
                self.encoder_cache.release(request.request_id, f.mm_hash)

    def _lora_fits(self, lora_id: int) -> bool:
        running = {r.lora_id for r in self.running if r.lora_id}
        return lora_id in running or len(running) < self.max_loras

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        """Tokens to compute this step; 0 when the rest must run whole and does not fit yet."""
        num_remaining = request.num_tokens - num_computed_tokens
        if num_remaining <= token_budget:
            return num_remaining
        can_split = self.config.enable_chunked_prefill or num_remaining > self.config.max_num_batched_tokens
        return token_budget if can_split else 0

    def _num_lookahead_tokens(self, request: Request, num_new_tokens: int, token_budget: int) -> int:
        """Slots for proposed tokens: a decoding request (its one new token is its last known) gets
        up to k while few requests run, never past its max_tokens, the pool or the budget."""
        spec = self.speculative
        if not spec.enabled or len(self.running) > spec.max_batch_size:
            return 0
        if num_new_tokens != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        if request.sampling_params.edits_logits:  # verification does not apply bias, min_tokens or grammars
            return 0
        # Emitting 1 + lookahead tokens must not pass the request's cap.
        room = min(request.max_num_tokens, self.max_num_tokens_in_pool) - request.num_tokens - 1
        return max(0, min(spec.num_speculative_tokens, room, token_budget - num_new_tokens))

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, step: _Step) -> Optional[list[int]]:
        """Allocate, preempting victims until it fits; None when the request itself was preempted."""
        while True:
            block_ids = self.kv_manager.allocate_slots(request, num_new_tokens)
            if block_ids is not None:
                return block_ids
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return None

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, request: Request, step: _Step) -> None:
        self.running.remove(request)
        # Free before resetting num_computed_tokens: it tells the manager which blocks hold K/V.
        self.kv_manager.free(request)
        self.encoder_cache.release(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(request, front=True)
        step.preempt(request)

    # -- bookkeeping --

    def _enqueue_waiting(self, request: Request, front: bool) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.waiting, request, key=_priority_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def _stop_status(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_tokens >= min(request.max_num_tokens, self.max_num_tokens_in_pool):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv_manager.free(request)
        self.encoder_cache.release(request.request_id)
        del self._requests[request.request_id]

    def _check_can_run(self, request: Request) -> None:
        num_prompt_tokens = request.num_prompt_tokens
        block_size = self.kv_manager.block_size
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if request.lora_id and not self.max_loras:
            raise ValueError(f"request {request.request_id} asks for LoRA adapter {request.lora_request.lora_name!r}, "
                             "but this engine serves none; start it with lora={...} (lora.enabled=true)")
        if request.max_model_len is not None and num_prompt_tokens > request.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt has {num_prompt_tokens} tokens, more than "
                f"max_model_len={request.max_model_len}; shorten the prompt"
            )
        if not self.config.enable_chunked_prefill and num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id}: prompt has {num_prompt_tokens} tokens, more than "
                f"scheduler.max_num_batched_tokens={self.config.max_num_batched_tokens}; raise "
                "max_num_batched_tokens or enable chunked prefill (scheduler.enable_chunked_prefill=true)"
            )
        largest = max((f.length for f in request.mm_features), default=0)
        if largest > min(self.encoder_cache.budget, self.encoder_cache.num_tokens):
            raise ValueError(f"request {request.request_id}: an image of {largest} tokens is larger than the encoder "
                             f"cache ({self.encoder_cache.num_tokens} tokens) or its budget per step "
                             f"({self.encoder_cache.budget}); raise scheduler.max_num_batched_tokens or send smaller images")
        if num_prompt_tokens > self.kv_manager.num_usable_blocks * block_size:
            raise ValueError(
                f"request {request.request_id}: prompt needs {-(-num_prompt_tokens // block_size)} KV blocks "
                f"of {block_size} tokens, the whole pool has {self.kv_manager.num_usable_blocks}; "
                "give the KV cache more memory (cache.kv_cache_memory_gib or cache.num_blocks) or shorten the prompt"
            )
