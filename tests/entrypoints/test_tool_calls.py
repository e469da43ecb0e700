"""Tool-call formats without a model: parsing, streaming deltas, the grammars that force a call, and
the fallback rendering for templates without tools."""

from __future__ import annotations

import json

import pytest

from kiln.entrypoints.openai.tool_calls import FORMATS, ToolStreamer, choose_format, tools_as_text

HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_hermes_parses_calls_after_text_and_keeps_malformed_ones_as_content():
    text = 'Let me check. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g"}'
    content, calls = HERMES.parse(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    for bad in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert HERMES.parse(bad) == (bad, [])
    assert HERMES.parse("plain") == ("plain", [])


def test_llama3_json_parses_whole_answers_only():
    content, calls = LLAMA.parse('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "arguments": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": "y"}), ("g", {})]
    for text in ('Sure: {"name": "f"}', '{"name": "f"', '{"no_name": 1}'):
        assert LLAMA.parse(text) == (text, [])


@pytest.mark.parametrize("fmt,text,want_content,want_calls", [
    (HERMES, 'Checking <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "Checking ", ["f"]),
    (HERMES, "I am <tool not a call", "I am <tool not a call", []),
    (LLAMA, '  {"name": "f", "parameters": {}}', "", ["f"]),
    (LLAMA, "Hello {there}", "Hello {there}", []),
])
def test_streamer_sends_content_until_a_call_and_the_call_at_the_end(fmt, text, want_content, want_calls):
    streamer = ToolStreamer(fmt)
    sent = "".join(streamer.content_delta(text[:k]) for k in range(1, len(text) + 1))
    rest, calls = streamer.finish(text)
    assert sent + rest == want_content and [c["function"]["name"] for c in calls] == want_calls
    assert all(c["index"] == i and c["id"].startswith("call_") for i, c in enumerate(calls))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA])
def test_call_grammar_accepts_exactly_the_calls_of_the_named_tools(fmt):
    import xgrammar as xgr

    tools = [{"name": "weather", "parameters": CITY}, {"name": "clock"}]

    def accepts(grammar: str, text: str) -> bool:
        return xgr.testing._is_grammar_accept_string(grammar, text)

    named = fmt.call_grammar(tools, "weather")
    either = fmt.call_grammar(tools, None)
    good = fmt.write("weather", {"city": "Paris"})
    assert accepts(named, good) and accepts(either, good) and accepts(either, fmt.write("clock", {}))
    assert not accepts(named, fmt.write("clock", {})) and not accepts(named, fmt.write("weather", {"town": "x"}))
    assert fmt.parse(good)[1][0].name == "weather"


def test_choose_format_and_tools_as_text():
    assert choose_format("auto", "{% if tools %}<|python_tag|>{% endif %}") is LLAMA
    assert choose_format("auto", "<|im_start|>") is HERMES and choose_format("llama3_json", "") is LLAMA
    conversation = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
                    {"role": "tool", "content": "Rain.", "tool_call_id": "1"}]
    out = tools_as_text(HERMES, [{"name": "weather", "parameters": CITY}], conversation)
    assert out[0]["role"] == "system" and '"name": "weather"' in out[0]["content"]
    assert HERMES.parse(out[2]["content"])[1][0].name == "weather" and "tool_calls" not in out[2]
    assert out[3] == {"role": "tool", "content": "Rain."}
