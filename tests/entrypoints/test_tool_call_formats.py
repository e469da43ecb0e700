"""The tool-call formats beyond Hermes and Llama 3 JSON (Mistral, Qwen3-Coder XML, pythonic,
DeepSeek V3): parsing, streaming one character at a time, the grammars that force a call, ``auto``
by the chat template; and end to end, each format's exact text forced by a regex on a tiny random
model, its calls read back exactly, whole and streamed."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from kiln.config import TOOL_CALL_PARSERS, ServerConfig
from kiln.entrypoints.openai.tool_calls import FORMATS, ToolStreamer, choose_format
from tests.helpers.chat_models import exact_regex, streamed

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}
TOOLS = [{"name": "get_weather", "parameters": CITY}, {"name": "get_time"}]
NEW = ("mistral", "qwen3_coder", "pythonic", "deepseek_v3")

# Each format's text for two calls, as the models write them.
TWO_CALLS = {
    "mistral": 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
               '{"name": "get_time", "arguments": {}}]',
    "qwen3_coder": "Sure. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                   "</function>\n</tool_call>",
    "pythonic": '[get_weather(city="Paris", days=2), get_time()]',
    "deepseek_v3": "Sure. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                   "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}
WANT_CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", NEW)
def test_parses_two_calls_after_content(name):
    content, calls = FORMATS[name].parse(TWO_CALLS[name], TOOLS)
    assert content == (None if name == "pythonic" else "Sure.") and _calls(calls) == WANT_CALLS


def test_other_spellings_each_format_reads():
    assert _calls(FORMATS["mistral"].parse('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "X"}')[1]) \
        == [("get_time", {}), ("get_weather", {"city": "X"})]
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert _calls(FORMATS["deepseek_v3"].parse(v31)[1]) == [("get_time", {"tz": "UTC"})]
    assert _calls(FORMATS["pythonic"].parse("<|python_start|>[f(a=True, b=None, c=[1, 'x'], d=true)]<|python_end|>")[1]) \
        == [("f", {"a": True, "b": None, "c": [1, "x"], "d": True})]
    # Untyped (no tools): JSON where it reads as JSON, else text.
    xml = "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=s>\nhi there\n</parameter>\n</function>\n</tool_call>"
    assert _calls(FORMATS["qwen3_coder"].parse(xml)[1]) == [("f", {"n": 3, "s": "hi there"})]
    # A string parameter stays a string even when it looks like a number.
    typed = xml.replace("\n3\n", "\n007\n")
    assert _calls(FORMATS["qwen3_coder"].parse(typed, [{"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "string"}}}}])[1]) == [("f", {"n": "007", "s": "hi there"})]


@pytest.mark.parametrize("name,text", [
    ("mistral", "[TOOL_CALLS] not json"), ("mistral", "[TOOL_CALLS][{\"arguments\": {}}]"),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>"), ("qwen3_coder", "<tool_call><function=f>oops</function>"),
    ("pythonic", "[f(1)]"), ("pythonic", "Sure: [f()]"), ("pythonic", "[x + 1]"), ("pythonic", "[f(**k)]"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>garbage"),
])
def test_malformed_calls_stay_content(name, text):
    assert FORMATS[name].parse(text) == (text, [])


@pytest.mark.parametrize("name", NEW)
def test_streamed_one_character_at_a_time_sends_no_markup(name):
    fmt, text = FORMATS[name], TWO_CALLS[name]
    streamer = ToolStreamer(fmt, TOOLS)
    sent = [streamer.content_delta(text[:k]) for k in range(1, len(text) + 1)]
    rest, calls = streamer.finish(text)
    assert "".join(sent) + rest == ("" if name == "pythonic" else "Sure. ")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == WANT_CALLS
    assert [c["index"] for c in calls] == [0, 1]


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("seen", [0, 3, 6], ids=["all-at-the-end", "a-prefix-first", "content-first"])
def test_a_call_that_arrives_only_with_the_final_text_sends_no_markup(name, seen):
    """A lagging stream merges deltas, so the call's start may first be seen by ``finish``, with the
    content before it in the same text (or nothing sent before at all)."""
    fmt, text = FORMATS[name], TWO_CALLS[name]
    streamer = ToolStreamer(fmt, TOOLS)
    sent = streamer.content_delta(text[:seen]) if seen else ""
    rest, calls = streamer.finish(text)
    assert sent + rest == ("" if name == "pythonic" else "Sure. ")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == WANT_CALLS


@pytest.mark.parametrize("name", NEW)
def test_call_grammar_accepts_exactly_the_calls_of_the_named_tools(name):
    import xgrammar as xgr

    fmt = FORMATS[name]

    def accepts(grammar: str, text: str) -> bool:
        return xgr.testing._is_grammar_accept_string(grammar, text)

    named, either = fmt.call_grammar(TOOLS, "get_weather"), fmt.call_grammar(TOOLS, None)
    good = fmt.write("get_weather", {"city": "Paris", "days": 2})
    assert accepts(named, good) and accepts(either, good) and accepts(either, fmt.write("get_time", {}))
    assert not accepts(named, fmt.write("get_time", {})) and not accepts(named, fmt.write("get_weather", {"city": "X"}))
    assert _calls(fmt.parse(good, TOOLS)[1]) == [WANT_CALLS[0]]


def test_auto_chooses_by_the_template_and_names_match_the_config():
    for template, want in (("{{ '[TOOL_CALLS]' }}", "mistral"), ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
                           ("<tool_call>\n<function=", "qwen3_coder"), ("<|python_start|>", "pythonic"),
                           ("{% if tools %}<|python_tag|>{% endif %}", "llama3_json"), ("<|im_start|>", "hermes")):
        assert choose_format("auto", template).name == want, template
    assert choose_format("qwen3_xml", "").name == "qwen3_coder"
    assert set(TOOL_CALL_PARSERS) == {"auto", *FORMATS}
    with pytest.raises(ValueError, match="mistral"):
        ServerConfig(tool_call_parser="nope")


# ---- end to end -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(qwen3_chat_server):
    """One app per format over the shared engine (``tests/entrypoints/conftest.py``)."""
    path, _, server = qwen3_chat_server
    return path, {n: server(tool_call_parser=n) for n in NEW}


def _forced_calls(servers, name: str, stream: bool) -> tuple[str | None, list[dict], list[str]]:
    """(content, calls, finish reasons) of one chat request whose text is ``TWO_CALLS[name]``."""
    path, apps = servers
    out = apps[name].client().chat.completions.create(
        model=path, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=200, temperature=0,
        tools=[{"type": "function", "function": t} for t in TOOLS], stream=stream,
        extra_body={"structured_outputs": {"regex": exact_regex(TWO_CALLS[name])}})
    if stream:
        _, content, calls, finishes = streamed(out)
        return content, calls, finishes
    choice = out.choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    return choice.message.content, calls, [choice.finish_reason]


def test_forced_text_comes_back_as_calls(servers):
    """Every format, whole and streamed: the eight requests are sent at once, so they run as one batch."""
    cases = [(name, stream) for name in NEW for stream in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: _forced_calls(servers, *case), cases))
    for (name, stream), (content, calls, finishes) in zip(cases, results):
        want_content = None if name == "pythonic" else "Sure."
        if stream:
            assert content == ("" if want_content is None else want_content + " "), name  # no markup, ever
        else:
            assert content == want_content, name
        assert finishes == ["tool_calls"], (name, stream)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == WANT_CALLS, (name, stream)


def test_required_call_in_each_format(servers):
    path, apps = servers
    # Bounded values: a random model would write an unbounded string until max_tokens.
    bounded = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                "days": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["city", "days"]}

    def required(name):
        return apps[name].client().chat.completions.create(
            model=path, messages=[{"role": "user", "content": "Weather?"}], max_tokens=400, temperature=0,
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": bounded}}],
            tool_choice="required")

    with ThreadPoolExecutor(len(NEW)) as pool:  # at once: one batch
        outs = list(pool.map(required, NEW))
    for name, out in zip(NEW, outs):
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather", name
        assert set(json.loads(calls[0].function.arguments)) == {"city", "days"}, name
