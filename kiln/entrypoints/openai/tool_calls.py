"""Tool calling: the formats a model writes its calls in, parsed back into OpenAI's ``tool_calls``.

A ``ToolFormat`` knows one way of writing a call (``server.tool_call_parser``; ``auto`` picks by the
chat template):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them,
  after optional text (Hermes, Qwen 2.5 and 3, and the fallback for templates without tools).
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (``arguments`` also
  read), optionally after ``<|python_tag|>``, several separated by ``;`` (Llama 3.1 and later).

Rules kept here:
- ``tool_choice`` ``required`` and a named function are enforced with a grammar (the call in this
  format, its arguments matching the function's JSON schema); ``auto`` lets the model choose and
  parses what it wrote; ``none`` parses nothing.
- Text that does not parse as a call stays content: a malformed call is never dropped.
- Streaming (``ToolStreamer``): content is streamed until something that may start a call appears;
  from there text is held back and, when the choice finishes, sent as one ``tool_calls`` delta per
  call (id, name and the whole arguments), or as content if it was no call after all.
- A template that does not render tools (no ``tools`` in its source) gets them as a system message
  in the Hermes style, and earlier calls and results as text, so any chat model can be offered tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: Optional[int] = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolFormat:
    name = ""
    start_markers: tuple[str, ...] = ()  # text that may start a call

    def parse(self, text: str) -> tuple[Optional[str], list[ParsedCall]]:
        """(content, calls): calls found in ``text``; content is None when only calls were written."""
        raise NotImplementedError

    def write(self, name: str, arguments: dict) -> str:
        raise NotImplementedError

    def find_start(self, text: str) -> tuple[Optional[int], int]:
        """(where a call starts in ``text`` or None, how many final characters to hold back
        because they may yet become the start of one)."""
        raise NotImplementedError

    def call_schema(self, name: str, parameters: Optional[dict]) -> dict:
        raise NotImplementedError

    def call_grammar(self, tools: list[dict], name: Optional[str]) -> str:
        """EBNF of one call of the named function (or of any of ``tools``), its arguments matching
        the function's parameters."""
        import xgrammar as xgr

        chosen = [t for t in tools if name is None or t["name"] == name]
        calls = [xgr.Grammar.from_json_schema(json.dumps(self.call_schema(t["name"], t.get("parameters"))),
                                              any_whitespace=False, strict_mode=True) for t in chosen]
        grammar = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
        return str(self._wrap(grammar))

    def _wrap(self, grammar):
        return grammar


def _as_call(obj, arg_keys: tuple[str, ...]) -> Optional[ParsedCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesFormat(ToolFormat):
    name = "hermes"
    start_markers = ("<tool_call>",)

    def parse(self, text: str) -> tuple[Optional[str], list[ParsedCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for m in _HERMES_CALL.finditer(text, start):
            try:
                call = _as_call(json.loads(m.group(1)), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a call after all: the text stays content
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls

    def find_start(self, text: str) -> tuple[Optional[int], int]:
        i = text.find("<tool_call>")
        return (i if i >= 0 else None), _partial_marker(text, self.start_markers)

    def write(self, name: str, arguments: dict) -> str:
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"

    def call_schema(self, name: str, parameters: Optional[dict]) -> dict:
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}

    def _wrap(self, grammar):
        import xgrammar as xgr

        return xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), grammar,
                                  xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    start_markers = ("{", "<|python_tag|>")

    def parse(self, text: str) -> tuple[Optional[str], list[ParsedCall]]:
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
            call = _as_call(obj, ("parameters", "arguments"))
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


FORMATS = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}


def choose_format(option: str, chat_template: Optional[str]) -> ToolFormat:
    """``server.tool_call_parser``: a format's name, or ``auto`` (Llama 3's markers in the template
    mean llama3_json; anything else hermes)."""
    if option != "auto":
        return FORMATS[option]
    template = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    return FORMATS["llama3_json" if ("<|python_tag|>" in template or "ipython" in template) else "hermes"]


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

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
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
        """At the end: (content still unsent, tool_calls deltas)."""
        rest = text[self._sent:]
        if not self._holding:
            self._sent = len(text)
            return rest, []
        _, calls = self.fmt.parse(rest)
        self._sent = len(text)
        if not calls:
            return rest, []
        return "", [c.to_openai(i) for i, c in enumerate(calls)]


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                best = max(best, k)
                break
    return best
