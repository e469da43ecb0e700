"""LLM: the offline API. Builds an engine from keyword config groups and runs prompts to the end.

    llm = LLM(model="smollm2-135m-instruct", compile={"mode": "eager"})
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
"""

from __future__ import annotations

import dataclasses

import itertools
import logging
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from kiln.config import EngineConfig, ModelConfig
from kiln.entrypoints.beam_search import (
    BeamSearch, BeamSearchOutput, best_of_params, keep_best, new_search, ranks_outputs, search_output,
)
from kiln.entrypoints.media import OFFLINE, split_image_parts
from kiln.lora_request import LoRARequest
from kiln.outputs import RequestOutput
from kiln.runtime.engine import LLMEngine
from kiln.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]
Message = dict[str, str]


class LLM:
    """Offline generation. Every config group is a keyword: a dict or its dataclass.

    ``model`` may be a model name/path (the other ModelConfig fields then come as keywords, e.g.
    ``dtype="float32"``, ``max_model_len=2048``) or a dict / ModelConfig.
    """

    def __init__(self, model: Union[str, dict, ModelConfig] = "smollm2-135m-instruct", **kwargs: Any):
        model_fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"model"}  # LLM(path, quantization=...)
        model_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in model_fields}
        if isinstance(model, str):
            model = ModelConfig(model=model, **model_kwargs)
        elif model_kwargs:
            raise ValueError(f"pass {sorted(model_kwargs)} inside the model config, not beside it")
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.config = config
        self.engine = LLMEngine(self.config, entrypoint="offline")
        logger.info(self.engine.startup.ready_line())
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        add_special_tokens: bool = True,
        lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.
        ``lora_request``: the adapter every prompt runs with, or one per prompt (None: the base model)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if any(ranks_outputs(p) for p in params):
            return self._generate_ranked(prompts, params, priorities, loras, add_special_tokens, use_tqdm)
        ids = []
        try:
            for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, prio, add_special_tokens, lora_request=lora)
                ids.append(rid)
        except Exception:
            for rid in ids:  # a bad prompt in the batch must not leave the others holding blocks
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: Union[Prompt, dict, Sequence[Union[Prompt, dict]]], params: BeamSearchParams,
                    lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None,
                    add_special_tokens: bool = True) -> list[BeamSearchOutput]:
        """Beam search (``kiln.entrypoints.beam_search``: transformers' ``num_beams`` search) of each
        prompt: a string, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``.
        Each output holds the ``params.beam_width`` best beams, best first."""
        if isinstance(prompts, dict):
            prompts = [prompts]
        if isinstance(prompts, list) and any(isinstance(p, dict) for p in prompts):
            prompts = [_undict(p) for p in prompts]
        prompts = _as_prompt_list(prompts)
        searches = [BeamSearch(self.engine.tokenize(p, add_special_tokens), params, self._eos_token_ids(),
                               self.engine.max_model_len) for p in prompts]
        self._run_searches(searches, _as_lora_list(lora_request, len(prompts)))
        return [BeamSearchOutput(s.results(self.tokenizer)) for s in searches]

    def _generate_ranked(self, prompts: list[Prompt], params: list[SamplingParams], priorities: list[int],
                         loras: list[Optional[LoRARequest]], add_special_tokens: bool,
                         use_tqdm: bool) -> list[RequestOutput]:
        """``generate`` when some request asks for beam search or best_of > n: the sampled ones
        first (best_of samples each, the best n kept), then every beam search together."""
        outs: list[Optional[RequestOutput]] = [None] * len(prompts)
        sampled = [i for i, p in enumerate(params) if not p.use_beam_search]
        if sampled:
            done = self.generate([prompts[i] for i in sampled], [best_of_params(params[i]) for i in sampled], use_tqdm,
                                 [priorities[i] for i in sampled], add_special_tokens, [loras[i] for i in sampled])
            for i, out in zip(sampled, done):
                outs[i] = keep_best(out, params[i])
        beams = [i for i, p in enumerate(params) if p.use_beam_search]
        searches = [new_search(self.engine.tokenize(prompts[i], add_special_tokens), params[i], self._eos_token_ids(),
                               self.engine.max_model_len) for i in beams]
        self._run_searches(searches, [loras[i] for i in beams])
        for i, search in zip(beams, searches):
            prompt = prompts[i] if isinstance(prompts[i], str) else None
            outs[i] = search_output(search, str(next(self._ids)), prompt, params[i], self.tokenizer)
        return outs

    def _run_searches(self, searches: list[BeamSearch], loras: list[Optional[LoRARequest]]) -> None:
        """Step every search until each is done: all running beams of all of them in one batch of
        one-token requests per step (their common prefixes' blocks found in the prefix cache)."""
        while live := [(s, lora) for s, lora in zip(searches, loras) if not s.done]:
            ids = []
            try:
                for search, lora in live:
                    for prompt in search.step_prompts():
                        rid = str(next(self._ids))
                        self.engine.add_request(rid, prompt, search.step_params(), lora_request=lora)
                        ids.append(rid)
            except Exception:
                for rid in ids:
                    self.engine.abort_request(rid)
                raise
            outs = iter(self._run(ids, use_tqdm=False))
            for search, _ in live:
                search.advance([next(outs).outputs[0].logprobs[0] for _ in search.running])

    def _eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.executor.eos_token_ids

    def embed(self, prompts: Union[Prompt, Sequence[Prompt]], pooling: str = "last",
              use_tqdm: bool = False) -> list[list[float]]:
        """One L2-normalized embedding per prompt: the final hidden state of its last token
        (``pooling="last"``) or their mean over the prompt (``"mean"``), batched like generation."""
        prompts = _as_prompt_list(prompts)
        ids = []
        try:
            for prompt in prompts:
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, SamplingParams(max_tokens=1), pooling=pooling)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [out.embedding for out in self._run(ids, use_tqdm)]

    def chat(
        self,
        messages: Union[list[Message], list[list[Message]]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate.
        ``continue_final_message``: the last message is continued in place (with
        ``add_generation_prompt=False``); ``chat_template_kwargs``: more of the template's variables
        (``{"enable_thinking": False}`` for Qwen3's); ``lora_request``: as ``generate``'s, one for
        every conversation or one each."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for c in conversations:  # image parts (image_url, image_pil) become the template's placeholders
            c, images = split_image_parts(c, OFFLINE)
            text = self.apply_chat_template(c, add_generation_prompt, continue_final_message, chat_template_kwargs)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self.generate(prompts, sampling_params, use_tqdm, add_special_tokens=False, lora_request=lora_request)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: Optional[dict[str, Any]] = None) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message; pass add_generation_prompt=False")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message,
                                                  **(chat_template_kwargs or {}))

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="requests", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while len(final) < len(ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine went idle with requests unfinished")
                for out in self.engine.step(finished_only=True):
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[i] for i in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):  # a dict: {"prompt": ..., "multi_modal_data": {"image": [...]}}
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not isinstance(p, (str, list, dict)):
            raise ValueError(f"each prompt must be a string, a list of token ids or a prompt dict, got {type(p).__name__}")
    return prompts


def _as_lora_list(loras, n: int) -> list[Optional[LoRARequest]]:
    if loras is None or isinstance(loras, LoRARequest):
        return [loras] * n
    loras = list(loras)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts")
    for lora in loras:
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"each lora_request must be a LoRARequest or None, got {type(lora).__name__}")
    return loras


def _undict(prompt: Union[Prompt, dict]) -> Prompt:
    """vLLM's prompt dicts as kiln's prompts."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"a prompt dict needs `prompt` or `prompt_token_ids`, got keys {sorted(prompt)}")


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
