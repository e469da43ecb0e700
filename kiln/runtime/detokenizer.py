"""Incremental detokenization and stop strings for one output sequence.

It owns the output text of one sample. Rules it keeps:

- Cost per token is O(1) in the sequence length: each step decodes only a short window of
  tokens (prefix offset .. end) and diffs it against the window's known part (prefix offset ..
  read offset), the scheme of HF TGI and vLLM.
- A character whose UTF-8 bytes span several tokens is held back while the window's text ends
  with U+FFFD, and released whole once its last byte arrives.
- Released text never has to be taken back: text that could still be the start of a stop string
  is held until it is clear, then released, or cut when the stop string completes.
- Token ids outside the tokenizer's vocabulary (a model with a bigger vocab than its tokenizer)
  decode to nothing.
"""

from __future__ import annotations

from typing import Optional

from kiln.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the first output token, so tokenizers that drop a leading
# space at the start of a decode (SentencePiece) still render the first output word right.
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes and every token adds at least one, so a window that still
# ends in U+FFFD after this many new tokens holds invalid bytes, not a split character: release it.
_MAX_PENDING_TOKENS = 6
_REPLACEMENT = "\ufffd"


def fast_decoder(tokenizer):
    """``decode(ids, skip_special_tokens) -> str``: the Rust tokenizer's own decode when the HF
    wrapper would return the same text (no clean-up of spaces), which skips the wrapper's
    per-call argument handling (most of the cost of a short window's decode); else the wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def detokenize_prompt(tokenizer, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    """The prompt's text; ids outside the tokenizer's vocabulary are skipped."""
    vocab_size = len(tokenizer)
    return tokenizer.decode([t for t in token_ids if 0 <= t < vocab_size],
                            skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Feed output tokens with ``add``; read deltas from it and the released text from ``.text``.

    ``.text`` is always the concatenation of every delta returned so far. Once a stop string
    completes, ``stop_string`` names it and later tokens are ignored. When the request ends for
    another reason, ``flush()`` releases what was held back.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._decode = fast_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings: list[str] = list(params.stop or [])
        # As in vLLM: a stop string counts only once more than min_tokens tokens are out, and only
        # if it ends in text that came after that.
        self.min_tokens = params.min_tokens
        self._num_tokens = 0
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_string: Optional[str] = None
        self._vocab_size = len(tokenizer)
        # Only the window's tokens matter: prompt context, then output tokens as they come.
        self._ids = [t for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:] if self._in_vocab(t)]
        if tokenizer.decode(self._ids, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT):
            # A prompt ending mid-character would make the first diff misaligned; go without.
            self._ids = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Decoded output text = released + pending. The released part never ends with a proper
        # prefix of a stop string, so a stop string match always starts inside pending.
        self._released = ""
        self._pending = ""
        self._finished = False

    @property
    def text(self) -> str:
        """The output text released so far: what the user has seen."""
        return self._released

    @property
    def finished(self) -> bool:
        return self._finished

    def check_stop(self) -> Optional[str]:
        """The stop string that ended the output, or None."""
        return self.stop_string

    def add(self, token_id: int) -> str:
        """Take one output token; return the text it releases (often "", never taken back)."""
        if self._finished:
            return ""
        self._num_tokens += 1
        checked = len(self._pending)  # text before this token's was searched already (or exempt)
        if self._in_vocab(token_id):
            self._ids.append(token_id)
            self._decode_window(force=False)
        if self.stop_strings and self._num_tokens > self.min_tokens:
            self._find_stop(checked)
        return self._release(final=self._finished)

    def flush(self) -> str:
        """Finish the output: release held-back text, including an unfinished character."""
        if self._finished:
            return ""
        self._decode_window(force=True)
        self._finished = True
        return self._release(final=True)

    # ---- internals ------------------------------------------------------------------------------
    def _in_vocab(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab_size

    def _decode_window(self, force: bool) -> None:
        """Append the text the window's new tokens complete; keep a split character pending."""
        if self._read_offset == len(self._ids):
            return
        skip = self.skip_special_tokens
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        new_text = self._decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        num_pending = len(self._ids) - self._read_offset
        complete = len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT)
        if complete or force or num_pending >= _MAX_PENDING_TOKENS:
            self._pending += new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if new_text.endswith(_REPLACEMENT):
                # Invalid bytes were released as U+FFFD; restart the window after them so a
                # later byte can't merge with them and shift the diff of later decodes.
                self._prefix_offset = self._read_offset
        # Tokens before the prefix offset are never decoded again; drop them to keep memory O(1).
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _find_stop(self, checked: int) -> None:
        """Cut the pending text at the earliest stop string that ends past ``checked``, if any."""
        best: Optional[tuple[int, str]] = None
        for stop in self.stop_strings:
            index = self._pending.find(stop, max(0, checked - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self._pending = self._pending[:end]
        self.stop_string = stop
        self._finished = True

    def _release(self, final: bool) -> str:
        """Hand out pending text, keeping back a tail that could still begin a stop string."""
        end = len(self._pending) if final else len(self._pending) - self._stop_prefix_len()
        delta, self._pending = self._pending[:end], self._pending[end:]
        self._released += delta
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string."""
        text = self._pending
        longest = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
