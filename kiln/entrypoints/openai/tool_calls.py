"""Tool calling: the formats a model writes its calls in, parsed back into OpenAI's ``tool_calls``.

A ``ToolFormat`` knows one way of writing a call (``server.tool_call_parser``; ``auto`` picks by the
chat template):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them,
  after optional text (Hermes, Qwen 2.5 and 3, and the fallback for templates without tools).
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (``arguments`` also
  read), optionally after ``<|python_tag|>``, several separated by ``;`` (Llama 3.1 and later).
- ``mistral``, ``qwen3_coder``, ``pythonic``, ``deepseek_v3``: in ``tool_formats.py``, with the
  ``ToolFormat`` interface.

Rules kept here:
- ``tool_choice`` ``required`` and a named function are enforced with a grammar (the call in this
  format, its arguments matching the function's JSON schema); ``auto`` lets the model choose and
  parses what it wrote; ``none`` parses nothing.
- Text that does not parse as a call stays content: a malformed call is never dropped.
- Streaming (``ToolStreamer``): content is streamed until something that may start a call appears
  (a tail that may still become a marker is held back, so no piece of one is sent as content);
  from there text is held back and, when the choice finishes, sent as one ``tool_calls`` delta per
  call (id, name and the whole arguments), or as content if it was no call after all.
- A template that does not render tools (no ``tools`` in its source) gets them as a system message
  in the Hermes style, and earlier calls and results as text, so any chat model can be offered tools.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from kiln.entrypoints.openai.tool_formats import (
    DeepSeekV3Format, MistralFormat, ParsedCall, PythonicFormat, Qwen3CoderFormat, ToolFormat, as_call, partial_marker,
)

__all__ = ["FORMATS", "ParsedCall", "ToolFormat", "ToolStreamer", "choose_format", "template_renders_tools",
           "tools_as_text"]

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesFormat(ToolFormat):
    name = "hermes"
    start_markers = ("<tool_call>",)
    markers = ("<tool_call>", "</tool_call>")

    def parse(self, text: str, tools: Optional[list[dict]] = None) -> tuple[Optional[str], list[ParsedCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for m in _HERMES_CALL.finditer(text, start):
            try:
                call = as_call(json.loads(m.group(1)), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a call after all: the text stays content
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls

    def write(self, name: str, arguments: dict) -> str:
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"

    def _wrap(self, grammar):
        import xgrammar as xgr

        return xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), grammar,
                                  xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    start_markers = ("{", "<|python_tag|>")
    markers = ("<|python_tag|>",)

    def parse(self, text: str, tools: Optional[list[dict]] = None) -> tuple[Optional[str], list[ParsedCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = as_call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def find_start(self, text: str) -> tuple[Optional[int], int]:
        # A call is the whole answer: it can only start at the beginning.
        stripped = text.lstrip()
        if stripped.startswith(self.start_markers):
            return len(text) - len(stripped), 0
        if not stripped or "<|python_tag|>".startswith(stripped):
            return None, len(text)
        return None, 0

    def write(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def call_schema(self, name: str, parameters: Optional[dict]) -> dict:
        return {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters or {"type": "object"}},
                "required": ["name", "parameters"], "additionalProperties": False}


FORMATS = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(), Qwen3CoderFormat(),
                               PythonicFormat(), DeepSeekV3Format())}
# vLLM's other names for the same formats
FORMATS.update(qwen3_xml=FORMATS["qwen3_coder"], llama4_pythonic=FORMATS["pythonic"],
               deepseek_v31=FORMATS["deepseek_v3"])
TOOL_CALL_PARSERS = ("auto", *FORMATS)

# ``auto``: the first format whose markers the chat template writes (else hermes).
_TEMPLATE_MARKERS = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("deepseek_v3", ("tool▁calls▁begin",)),
    ("qwen3_coder", ("<function=",)),
    ("pythonic", ("<|python_start|>", "func_name1(")),
    ("llama3_json", ("<|python_tag|>", "ipython")),
)


def choose_format(option: str, chat_template: Optional[str]) -> ToolFormat:
    """``server.tool_call_parser``: a format's name, or ``auto`` (the format whose markers the chat
    template writes; hermes when none)."""
    if option != "auto":
        return FORMATS[option]
    template = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    for name, markers in _TEMPLATE_MARKERS:
        if any(m in template for m in markers):
            return FORMATS[name]
    return FORMATS["hermes"]


def template_renders_tools(chat_template) -> bool:
    template = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    return "tools" in template


def tools_as_text(fmt: ToolFormat, tools: list[dict], conversation: list[dict]) -> list[dict]:
    """The conversation for a template that renders no tools: the tools described in a system
    message, earlier calls written out in ``fmt``, results as user-visible tool turns."""
    listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
    example = fmt.write("<function-name>", {"<argument>": "<value>"})
    system = (f"You may call these tools:\n{listing}\nTo call one, answer with exactly:\n{example}" if tools else "")
    out = []
    for m in conversation:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            written = "\n".join(fmt.write(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            m["content"] = (m.get("content") or "") + written
        if m["role"] == "tool":
            m = {"role": "tool", "content": m.get("content") or ""}
        out.append(m)
    if system:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


class ToolStreamer:
    """One streamed choice's text split into content deltas and, at the end, tool-call deltas."""

    def __init__(self, fmt: ToolFormat, tools: Optional[list[dict]] = None):
        self.fmt = fmt
        self.tools = tools
        self._sent = 0  # characters sent as content
        self._holding = False  # a call may have started: hold the rest until the end

    def content_delta(self, text: str) -> str:
        """The content that may be sent now, given the choice's whole text so far."""
        if self._holding:
            return ""
        start, hold = self.fmt.find_start(text)
        if start is not None:
            self._holding = True
            end = start
            if not text[self._sent:end].strip():
                self._sent = end
                return ""  # only whitespace before the call: no content at all
        else:
            end = len(text) - hold
        delta = text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return delta

    def finish(self, text: str) -> tuple[str, list[dict]]:
        """At the end: (content still unsent, tool_calls deltas). A lagging stream's deltas merge, so
        a call may start only in this final text: it is looked for here too."""
        content = self.content_delta(text)
        rest = text[self._sent:]
        self._sent = len(text)
        if not self._holding:
            return content + rest, []
        _, calls = self.fmt.parse(rest, self.tools)
        if not calls:
            return content + rest, []
        return content, [c.to_openai(i) for i, c in enumerate(calls)]

