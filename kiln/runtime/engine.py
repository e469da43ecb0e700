"""LLMEngine: the engine core that the ``LLM`` API and the server both drive.

One step::

    sched   = scheduler.schedule()            # who runs, how many tokens each, which blocks
    result  = executor.execute_model(sched)   # forward + sample
    updated = scheduler.update(sched, result) # append tokens, finish on eos / length
    outputs = output_processor.process(...)   # detokenize, stop strings, group n samples

Rules: every request that enters leaves through a finish (stop, length, abort) and gives its
blocks back; bad input is refused in ``add_request`` with a ValueError that says what to change.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Union

from kiln.config import EngineConfig
from kiln.outputs import RequestOutput
from kiln.runtime.executor import make_executor
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.output_processor import OutputProcessor
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.scheduler import Scheduler
from kiln.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.executor = make_executor(config.model, config.cache, config.compile, config.parallel, config.scheduler)
        self.tokenizer = self.executor.tokenizer
        self.max_model_len = self.executor.max_model_len
        self.kv_manager = KVCacheManager(
            self.executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.output_processor = OutputProcessor(self.tokenizer)

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that cannot run as asked."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token of text")
        vocab = self.executor.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len}; "
                "shorten the prompt (or raise model.max_model_len if the model allows it)"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's context "
                f"of {self.max_model_len} tokens; lower max_tokens to at most {self.max_model_len - n}"
            )

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> None:
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenize(prompt, add_special_tokens)
        self.validate(prompt_ids, params)
        samples = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=prompt_ids,
                sampling_params=params if params.seed is None else _with_seed(params, params.seed + i),
                eos_token_id=self.executor.eos_token_id,
                max_model_len=self.max_model_len,
                priority=priority,
            )
            for i in range(params.n)
        ]
        for req in samples:
            self.scheduler.add_request(req)
        self.output_processor.add(request_id, prompt if isinstance(prompt, str) else None, samples)

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Finish a user request now (all its samples) and free its blocks."""
        sample_ids = self.output_processor.sample_ids(request_id)
        for sid in sample_ids:
            self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
        self.executor.forget(sample_ids)
        return self.output_processor.abort(request_id)

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        result = self.executor.execute_model(sched)
        updated = self.scheduler.update(sched, result.sampled_token_ids)
        outputs, stopped = self.output_processor.process(updated, result.logprobs)
        for sid in stopped:
            self.scheduler.finish_request(sid, RequestStatus.FINISHED_STOPPED)
        finished = [r.request_id for r in updated if r.is_finished]
        if finished:
            self.executor.forget(finished)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> dict:
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": self.kv_manager.num_free_blocks,
            "num_blocks": self.executor.num_blocks,
            "num_usable_blocks": self.kv_manager.num_usable_blocks,
            "prefix_cache_hit_rate": self.kv_manager.hit_rate,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    # Each of n seeded samples gets its own seed, so they differ but stay reproducible.
    return dataclasses.replace(params, seed=seed, n=1)
