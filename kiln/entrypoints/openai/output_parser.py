"""One choice's generated text as an API answers it: reasoning, content and tool calls.

The reasoning split comes first (``reasoning.py``), and tool calls are read from the answer only
(``tool_calls.py``), so a call the model only thought about is never made. Any handler uses it:
``parse_output`` for a finished text, ``OutputStream`` for the text so far while streaming (its
deltas add up to exactly what ``parse_output`` returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kiln.entrypoints.openai.reasoning import ReasoningSplit, ReasoningStream
from kiln.entrypoints.openai.tool_calls import ParsedCall, ToolFormat, ToolStreamer


@dataclass
class ParsedOutput:
    reasoning: Optional[str]
    content: Optional[str]
    tool_calls: list[ParsedCall] = field(default_factory=list)


def parse_output(text: str, reasoning: Optional[ReasoningSplit], fmt: Optional[ToolFormat],
                 tools: Optional[list[dict]] = None) -> ParsedOutput:
    """``text`` split into reasoning, content and calls (``fmt`` None: no tool calls; ``reasoning``
    None: no reasoning split). With a reasoning split, an empty answer is None."""
    thought, answer = reasoning.split(text) if reasoning is not None else ("", text)
    content, calls = fmt.parse(answer, tools) if fmt is not None else (answer, [])
    if reasoning is not None and not content:
        content = None
    return ParsedOutput(thought or None, content, calls)


@dataclass
class StreamDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's tool_calls deltas, at the end only


class OutputStream:
    """One streamed choice: feed its whole text so far, get what may be sent now."""

    def __init__(self, reasoning: Optional[ReasoningSplit], fmt: Optional[ToolFormat],
                 tools: Optional[list[dict]] = None):
        self._reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self._tools = ToolStreamer(fmt, tools) if fmt is not None else None
        self._sent = 0  # content characters sent, without a tool streamer

    def delta(self, text: str) -> StreamDelta:
        thought, answer = self._split(text, final=False)
        if self._tools is not None:
            return StreamDelta(thought, self._tools.content_delta(answer))
        return StreamDelta(thought, self._content(answer))

    def finish(self, text: str) -> StreamDelta:
        thought, answer = self._split(text, final=True)
        if self._tools is not None:
            content, calls = self._tools.finish(answer)
            return StreamDelta(thought, content, calls)
        return StreamDelta(thought, self._content(answer))

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self._reasoning is None:
            return "", text
        thought = self._reasoning.delta(text, final)
        return thought, self._reasoning.content

    def _content(self, answer: str) -> str:
        delta = answer[self._sent:]
        self._sent = max(self._sent, len(answer))
        return delta
