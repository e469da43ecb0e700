"""InputProcessor: a prompt's tokenization and every check a request passes before it may run.

Rules it keeps:
- Bad input raises ValueError with a message that starts with the field it refuses and says what
  to change; the server turns it into HTTP 400. Text that cannot be tokenized (a lone surrogate)
  is bad input too, never a crash.
- It holds only the tokenizer and constants, so any thread may call it: the server runs it on its
  event loop before the engine thread sees the request, and the engine runs it again (without
  tokenizing) on whatever it is handed.
- Everything a step later reads from a request (token ids, seeds) is checked here: a step fails
  as a whole, so a bad value must never reach one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from kiln.runtime.multimodal import MM_DATA, ImageFeature, MultimodalProcessor
from kiln.sampling_params import SEED_MAX, SEED_MIN, SamplingParams


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt ``InputProcessor.process`` tokenized; processing it again only re-checks it."""

    text: Optional[str]  # None when the prompt came as token ids
    token_ids: list[int]
    mm_features: tuple[ImageFeature, ...] = ()  # its images, placeholders expanded in token_ids


# A dict prompt is vLLM's: {"prompt": text or "prompt_token_ids": ids, "multi_modal_data": {"image": [...]}}.
Prompt = Union[str, list[int], TokenizedPrompt, dict]


class InputProcessor:
    """Tokenizes and checks prompts. It holds only the tokenizer and constants, so any thread may
    call it (the server calls it on its event loop, while the engine thread steps)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, grammars=None,
                 mm_processor: Optional[MultimodalProcessor] = None):
        """``grammars``: a ``GrammarCompiler`` (thread-safe, cached) that checks structured outputs.
        ``mm_processor``: a vision-language model's image processing (None: the model reads text only)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.mm_processor = mm_processor

    def process(self, prompt: Prompt, params: SamplingParams, add_special_tokens: bool = True) -> TokenizedPrompt:
        """Raise ValueError (saying what to change) for a request that cannot run as asked."""
        if isinstance(prompt, TokenizedPrompt):
            processed = prompt
        elif isinstance(prompt, dict):
            processed = self._process_dict(prompt, add_special_tokens)
        elif isinstance(prompt, str):
            processed = TokenizedPrompt(prompt, self.tokenize(prompt, add_special_tokens))
        else:
            processed = TokenizedPrompt(None, list(prompt))
        self.validate(processed.token_ids, params)
        self._validate_features(processed)
        return processed

    def _process_dict(self, prompt: dict[str, Any], add_special_tokens: bool) -> TokenizedPrompt:
        unknown = set(prompt) - {"prompt", "prompt_token_ids", MM_DATA}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"a dict prompt has `prompt` (text) or `prompt_token_ids`, and optionally `{MM_DATA}`; "
                             f"got keys {sorted(prompt)}")
        text = prompt.get("prompt")
        ids = self.tokenize(text, add_special_tokens) if text is not None else list(prompt["prompt_token_ids"])
        data = prompt.get(MM_DATA) or {}
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"{MM_DATA} takes {{'image': [images]}}; kiln reads no other modality "
                             f"(got {sorted(data) if isinstance(data, dict) else type(data).__name__})")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            return TokenizedPrompt(text, ids)
        if self.mm_processor is None:
            raise ValueError(f"{MM_DATA}: this model reads text only; serve a vision-language model for images")
        ids, features = self.mm_processor.expand(ids, images)
        return TokenizedPrompt(text, ids, features)

    def _validate_features(self, processed: TokenizedPrompt) -> None:
        """Each image's placeholders lie in the prompt, in order, without overlapping."""
        end = 0
        for f in processed.mm_features:
            if f.offset < end or f.length <= 0 or f.end > len(processed.token_ids):
                raise ValueError(f"{MM_DATA}: image at tokens [{f.offset}, {f.end}) does not fit the prompt")
            end = f.end
        if processed.mm_features and self.mm_processor is None:
            raise ValueError(f"{MM_DATA}: this model reads text only; serve a vision-language model for images")

    def tokenize(self, prompt: Union[str, list[int]], add_special_tokens: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in JSON) is no text
            raise ValueError(f"prompt is not valid Unicode text: {e.reason} at character {e.start} "
                             f"({prompt[e.start:e.end]!r}); send text without lone surrogates") from e
        try:
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        except (TypeError, UnicodeError) as e:
            raise ValueError(f"prompt could not be tokenized: {e}") from e

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that cannot run as asked."""
        if params.use_beam_search or params.beam_width != params.n:
            raise ValueError("use_beam_search and best_of are run by LLM.generate and the OpenAI server (as requests "
                             "of n samples each); LLMEngine.add_request takes neither")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token of text")
        vocab = self.vocab_size
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
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}); got {bad[:5]}")
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs: this engine has no grammar compiler")
            self.grammars.compile(params.structured_outputs)  # GrammarError (a ValueError) says why
        # SamplingParams checks on construction, but it is mutable: a step must never see a bad seed.
        if params.seed is not None and not (isinstance(params.seed, int) and SEED_MIN <= params.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (signed 64-bit), "
                             f"got {params.seed!r}")
