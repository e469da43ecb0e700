"""Reasoning parsers: a reasoning model's thinking split from its answer (``server.reasoning_parser``).

A ``ReasoningFormat`` (vLLM's parser names) knows the markers around a model's thinking; one
request's ``ReasoningSplit`` (``for_request``) knows where its output begins and splits the text
into ``reasoning_content`` and ``content``, whole or streamed. Rules kept here:

- Where the output begins: a thinking switch in ``chat_template_kwargs`` (``enable_thinking`` or
  ``thinking``) set to false makes the whole output content; else a prompt that ends with the end
  marker (the template closed the thinking: Qwen3's ``enable_thinking=false``) begins in the
  answer; a prompt that ends with the start marker begins in the thinking; otherwise the format
  says (DeepSeek-R1 and Qwen3 begin thinking: their templates or the model write ``<think>``).
- A start marker at the very beginning of the output is dropped; the first end marker ends the
  thinking; without one, everything is reasoning (a thinking that ran out of tokens).
- Reasoning is stripped of surrounding whitespace and content of leading whitespace; an empty
  field is None.
- Streaming splits the text so far with the same rule and sends what grew, holding back any tail
  that may still become a marker, so no marker (nor a piece of one) ever reaches either field,
  however the text is split into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional


class Begin(Enum):
    CONTENT = "content"  # thinking off: the whole output is the answer
    THINKING = "thinking"  # the output begins inside the thinking
    EITHER = "either"  # the answer, unless the output opens with the start marker


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    begins_thinking: bool  # with no switch or prompt marker saying otherwise
    thinking_by_default: bool = True  # False: only a switch set to true turns thinking on

    def for_request(self, prompt_text: Optional[str], template_kwargs: Optional[dict]) -> "ReasoningSplit":
        """How one request's output is split, from its rendered prompt and template switches."""
        switches = [v for k, v in (template_kwargs or {}).items() if k in ("enable_thinking", "thinking")]
        thinking = bool(switches[-1]) if switches else self.thinking_by_default
        tail = (prompt_text or "").rstrip()
        if not thinking or tail.endswith(self.end):
            begin = Begin.CONTENT
        elif tail.endswith(self.start) or self.begins_thinking:
            begin = Begin.THINKING
        else:
            begin = Begin.EITHER
        return ReasoningSplit(self, begin)


REASONING_FORMATS = {f.name: f for f in (
    ReasoningFormat("deepseek_r1", "<think>", "</think>", begins_thinking=True),
    ReasoningFormat("qwen3", "<think>", "</think>", begins_thinking=True),
    # DeepSeek V3.1 and later: thinking only when the request turns it on (``thinking: true``).
    ReasoningFormat("deepseek_v3", "<think>", "</think>", begins_thinking=True, thinking_by_default=False),
    ReasoningFormat("minimax_m2", "<think>", "</think>", begins_thinking=True),
    ReasoningFormat("glm45", "<think>", "</think>", begins_thinking=False),
    ReasoningFormat("mistral", "[THINK]", "[/THINK]", begins_thinking=False),
    ReasoningFormat("seed_oss", "<seed:think>", "</seed:think>", begins_thinking=True),
)}


def reasoning_format(name: Optional[str]) -> Optional[ReasoningFormat]:
    """``server.reasoning_parser``: None (no parsing) or one of ``REASONING_FORMATS``."""
    if name is None:
        return None
    if name not in REASONING_FORMATS:
        raise ValueError(f"server.reasoning_parser must be one of {sorted(REASONING_FORMATS)} or null, got {name!r}")
    return REASONING_FORMATS[name]


@dataclass(frozen=True)
class ReasoningSplit:
    fmt: ReasoningFormat
    begin: Begin

    @property
    def defers_grammar(self) -> bool:
        """A grammar must wait for the end marker: the output begins inside the thinking."""
        return self.begin is Begin.THINKING

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of ``text``; before ``final``, without any tail that may still become a
        marker or trailing whitespace of the reasoning, so that each grows by appending only."""
        if self.begin is Begin.CONTENT:
            return "", text
        start, end = self.fmt.start, self.fmt.end
        lead = text.lstrip()
        if not final and start.startswith(lead):
            return "", ""  # nothing yet, or the start marker still arriving
        if lead.startswith(start):
            body = lead[len(start):]
        elif self.begin is Begin.EITHER:
            return "", text
        else:
            body = lead
        i = body.find(end)
        if i >= 0:
            return body[:i].strip(), body[i + len(end):].lstrip()
        if final:
            return body.strip(), ""
        return body[:len(body) - _partial_suffix(body, end)].strip(), ""


class ReasoningStream:
    """One streamed choice's reasoning and content deltas, from its whole text so far."""

    def __init__(self, split: ReasoningSplit):
        self.split = split
        self._sent_reasoning = 0
        self._content = ""  # the content so far (what the tool-call streamer reads)

    def delta(self, text: str, final: bool = False) -> str:
        """The reasoning that may be sent now; ``content`` then holds all content so far."""
        reasoning, self._content = self.split.split(text, final)
        delta = reasoning[self._sent_reasoning:]
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        return delta

    @property
    def content(self) -> str:
        return self._content


def _partial_suffix(text: str, marker: str) -> int:
    """How many final characters of ``text`` could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
