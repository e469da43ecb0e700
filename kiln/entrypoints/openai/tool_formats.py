"""How a model writes a tool call: the ``ToolFormat`` interface and the formats beyond Hermes and
Llama 3 JSON (those two, the registry and streaming are in ``tool_calls.py``).

- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` per call (Mistral, Mixtral, Magistral, Devstral).
- ``qwen3_coder``: ``<tool_call>\\n<function=name>\\n<parameter=x>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``,
  each value read by its parameter's JSON type (Qwen3-Coder, Qwen3.5).
- ``pythonic``: the whole answer is ``[f(a=1), g(b="x")]`` of Python literals, optionally inside
  ``<|python_start|>...<|python_end|>`` (Llama 3.2 pythonic, Llama 4).
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...``,
  or V3.1's ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.

Each format parses what the model wrote (text that is no call stays content), writes a call (for
templates that render no tools) and builds the grammar that forces one call (``call_grammar``).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional


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
    markers: tuple[str, ...] = ()  # every marker the format writes (kept in the text even if special tokens)

    def parse(self, text: str, tools: Optional[list[dict]] = None) -> tuple[Optional[str], list[ParsedCall]]:
        """(content, calls): calls found in ``text``; content is None when only calls were written.
        ``tools`` (name, parameters) types the values of formats that write them untyped."""
        raise NotImplementedError

    def write(self, name: str, arguments: dict) -> str:
        raise NotImplementedError

    def find_start(self, text: str) -> tuple[Optional[int], int]:
        """(where a call starts in ``text`` or None, how many final characters to hold back
        because they may yet become the start of one). This default: a call starts at any
        ``start_markers``."""
        starts = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return (min(starts) if starts else None), partial_marker(text, self.start_markers)

    def call_schema(self, name: str, parameters: Optional[dict]) -> dict:
        """The JSON object one call is written as (formats that write calls as JSON)."""
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}

    def call_grammar(self, tools: list[dict], name: Optional[str]) -> str:
        """EBNF of one call of the named function (or of any of ``tools``), its arguments matching
        the function's parameters."""
        import xgrammar as xgr

        chosen = [t for t in tools if name is None or t["name"] == name]
        calls = [self._call(xgr, t["name"], t.get("parameters")) for t in chosen]
        grammar = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
        return str(self._wrap(grammar))

    def _call(self, xgr, name: str, parameters: Optional[dict]):
        return xgr.Grammar.from_json_schema(json.dumps(self.call_schema(name, parameters)),
                                            any_whitespace=False, strict_mode=True)

    def _wrap(self, grammar):
        return grammar


def as_call(obj, arg_keys: tuple[str, ...]) -> Optional[ParsedCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                best = max(best, k)
                break
    return best


def _text(xgr, text: str):
    """The grammar whose one sentence is ``text``."""
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def _args_json(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class MistralFormat(ToolFormat):
    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)
    markers = ("[TOOL_CALLS]", "[ARGS]")

    def parse(self, text: str, tools: Optional[list[dict]] = None) -> tuple[Optional[str], list[ParsedCall]]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        for part in text[start:].split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            try:
                if part.startswith("["):  # a JSON list of calls
                    obj, end = decoder.raw_decode(part)
                    found = [as_call(o, ("arguments", "parameters")) for o in obj] if isinstance(obj, list) else [None]
                    if part[end:].strip() or not found:
                        return text, []
                elif "[ARGS]" in part:  # name[ARGS]{...}
                    name, _, args = part.partition("[ARGS]")
                    obj, end = decoder.raw_decode(args.strip())
                    found = [ParsedCall(name.strip(), json.dumps(obj, ensure_ascii=False))
                             if name.strip() and isinstance(obj, dict) and not args.strip()[end:].strip() else None]
                else:
                    return text, []
            except ValueError:
                return text, []
            if any(c is None for c in found):
                return text, []
            calls += found
        content = text[:start].strip()
        return content or None, calls

    def write(self, name: str, arguments: dict) -> str:
        return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": arguments}], ensure_ascii=False)

    def _wrap(self, grammar):
        import xgrammar as xgr

        return xgr.Grammar.concat(_text(xgr, "[TOOL_CALLS]["), grammar, _text(xgr, "]"))


_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|$)", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderFormat(ToolFormat):
    name = "qwen3_coder"
    start_markers = ("<tool_call>",)
    markers = ("<tool_call>", "</tool_call>")

    def parse(self, text: str, tools: Optional[list[dict]] = None) -> tuple[Optional[str], list[ParsedCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        types = {t["name"]: (t.get("parameters") or {}).get("properties", {}) for t in tools or []}
        calls, pos = [], start
        for m in _XML_CALL.finditer(text, start):
            if text[pos:m.start()].strip():
                return text, []  # text between calls: not this format's calls
            name = m.group(1).strip()
            body = m.group(2)
            params = {p.group(1).strip(): _typed(p.group(2), types.get(name, {}).get(p.group(1).strip()))
                      for p in _XML_PARAM.finditer(body)}
            if _XML_PARAM.sub("", body).strip():
                return text, []  # something in the function that is no parameter
            calls.append(ParsedCall(name, json.dumps(params, ensure_ascii=False)))
            pos = m.end()
        if not calls or text[pos:].strip():
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def write(self, name: str, arguments: dict) -> str:
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                         f"</parameter>\n" for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    def _call(self, xgr, name: str, parameters: Optional[dict]):
        """The function's required parameters in the schema's order, each value as its type writes it
        (a string raw, anything else as JSON)."""
        properties = (parameters or {}).get("properties", {})
        parts = [_text(xgr, f"<tool_call>\n<function={name}>\n")]
        for key in (parameters or {}).get("required", []):
            schema = properties.get(key, {})
            parts.append(_text(xgr, f"<parameter={key}>\n"))
            if schema.get("type") == "string":
                parts.append(_raw_string(xgr, schema))
            else:
                parts.append(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
            parts.append(_text(xgr, "\n</parameter>\n"))
        parts.append(_text(xgr, "</function>\n</tool_call>"))
        return xgr.Grammar.concat(*parts)


def _raw_string(xgr, schema: dict):
    """A string parameter as Qwen3-Coder writes it: unquoted, on one line (its enum, or up to
    maxLength characters)."""
    if schema.get("enum"):
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(str(v), ensure_ascii=False)
                                                               for v in schema["enum"]))
    limit = schema.get("maxLength")
    return xgr.Grammar.from_ebnf("root ::= [^<\\n]" + (f"{{1,{int(limit)}}}" if limit else "+"))


def _typed(value: str, schema: Optional[dict]) -> Any:
    """A parameter's raw text as its JSON type: a string stays text; other types are read as JSON
    (text that is not JSON stays a string)."""
    kind = (schema or {}).get("type")
    if kind == "string" or (schema is not None and kind is None and "enum" not in schema):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


_PY_NAMES = {"true": True, "false": False, "null": None}


class PythonicFormat(ToolFormat):
    name = "pythonic"
    start_markers = ("[", "<|python_start|>")
    markers = ("<|python_start|>", "<|python_end|>")

    def parse(self, text: str, tools: Optional[list[dict]] = None) -> tuple[Optional[str], list[ParsedCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = [self._call_of(node) for node in tree.elts]
        except (SyntaxError, ValueError):
            return text, []
        return None, calls

    @staticmethod
    def _call_of(node) -> ParsedCall:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            raise ValueError("not a call with keyword arguments")
        name = ast.unparse(node.func)
        args = {kw.arg: _py_value(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(args) != len(node.keywords):
            raise ValueError("**kwargs")
        return ParsedCall(name, json.dumps(args, ensure_ascii=False))

    def find_start(self, text: str) -> tuple[Optional[int], int]:
        # The calls are the whole answer: they can only start at the beginning.
        stripped = text.lstrip()
        if stripped.startswith(self.start_markers):
            return len(text) - len(stripped), 0
        if not stripped or "<|python_start|>".startswith(stripped):
            return None, len(text)
        return None, 0

    def write(self, name: str, arguments: dict) -> str:
        return "[" + name + "(" + ", ".join(f"{k}={_py_literal(v)}" for k, v in arguments.items()) + ")]"

    def _call(self, xgr, name: str, parameters: Optional[dict]):
        """``[name(a=<JSON value>, ...)]`` with the required parameters in the schema's order (JSON's
        true, false and null read as Python's)."""
        properties = (parameters or {}).get("properties", {})
        parts = [_text(xgr, f"[{name}(")]
        for k, key in enumerate((parameters or {}).get("required", [])):
            parts.append(_text(xgr, (", " if k else "") + key + "="))
            parts.append(xgr.Grammar.from_json_schema(json.dumps(properties.get(key, {})), any_whitespace=False,
                                                      strict_mode=True))
        parts.append(_text(xgr, ")]"))
        return xgr.Grammar.concat(*parts)


def _py_value(node) -> Any:
    if isinstance(node, ast.Name) and node.id in _PY_NAMES:
        return _PY_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_py_value(v) for v in node.elts]
    if isinstance(node, ast.Dict):
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values)}
    value = ast.literal_eval(node)
    if isinstance(value, tuple):
        return list(value)
    return value


def _py_literal(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py_literal(k)}: {_py_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_py_literal(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_CALL = re.compile(re.escape(_DS_CALL_BEGIN) + r"(?:function" + re.escape(_DS_SEP)
                      + r"([^\n]+)\n```(?:json)?\n(.*?)\n```|([^\n]+?)" + re.escape(_DS_SEP) + r"(.*?))"
                      + re.escape(_DS_CALL_END), re.DOTALL)


class DeepSeekV3Format(ToolFormat):
    name = "deepseek_v3"
    start_markers = (_DS_BEGIN,)
    markers = (_DS_BEGIN, _DS_END, _DS_CALL_BEGIN, _DS_CALL_END, _DS_SEP)

    def parse(self, text: str, tools: Optional[list[dict]] = None) -> tuple[Optional[str], list[ParsedCall]]:
        start = text.find(_DS_BEGIN)
        if start < 0:
            return text, []
        body = text[start + len(_DS_BEGIN):]
        body = body[:body.find(_DS_END)] if _DS_END in body else body
        calls, pos = [], 0
        for m in _DS_CALL.finditer(body):
            if body[pos:m.start()].strip():
                return text, []
            name, args = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
            try:
                obj = json.loads(args)
            except ValueError:
                return text, []
            if not isinstance(obj, dict):
                return text, []
            calls.append(ParsedCall(name.strip(), json.dumps(obj, ensure_ascii=False)))
            pos = m.end()
        if not calls or body[pos:].strip():
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def write(self, name: str, arguments: dict) -> str:
        return (f"{_DS_BEGIN}{_DS_CALL_BEGIN}function{_DS_SEP}{name}\n```json\n"
                f"{json.dumps(arguments, ensure_ascii=False)}\n```{_DS_CALL_END}{_DS_END}")

    def _call(self, xgr, name: str, parameters: Optional[dict]):
        args = xgr.Grammar.from_json_schema(json.dumps(parameters or {"type": "object"}), any_whitespace=False,
                                            strict_mode=True)
        head = f"{_DS_BEGIN}{_DS_CALL_BEGIN}function{_DS_SEP}{name}\n```json\n"
        return xgr.Grammar.concat(_text(xgr, head), args, _text(xgr, "\n```" + _DS_CALL_END + _DS_END))
