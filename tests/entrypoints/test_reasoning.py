"""Reasoning parsers: each format's split fed whole and one character at a time, and end to end a
tiny random model with a Qwen3-style template whose output a regex forces exactly; the grammar of
a request waits for the thinking's end (``after_token_ids``) unless told otherwise."""

from __future__ import annotations

import json

import httpx
import pytest

from kiln.config import REASONING_PARSERS, ServerConfig
from kiln.entrypoints.openai.output_parser import OutputStream, parse_output
from kiln.entrypoints.openai.reasoning import REASONING_FORMATS, Begin, reasoning_format
from kiln.entrypoints.openai.tool_calls import FORMATS
from tests.helpers.chat_models import exact_regex, streamed
from tests.helpers.server import assert_error

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _char_by_char(split, fmt, text: str):
    """(reasoning, content, calls) streamed one character per delta, each delta checked marker-free."""
    stream = OutputStream(split, fmt)
    deltas = [stream.delta(text[:k]) for k in range(1, len(text))] + [stream.finish(text)]
    for d in deltas:
        for piece in (d.reasoning, d.content):
            assert "<" not in piece and "[" not in piece, deltas  # no marker, nor a piece of one
    reasoning = "".join(d.reasoning for d in deltas)
    return reasoning, "".join(d.content for d in deltas), [c["function"]["name"] for c in deltas[-1].tool_calls]


@pytest.mark.parametrize("name,prompt,kwargs,text,want", [
    ("qwen3", "<|im_start|>assistant\n", None, "<think>\nPlan it.\n</think>\n\nBlue.", ("Plan it.", "Blue.")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", None, "Plan it.\n</think>\n\nBlue.", ("Plan it.", "Blue.")),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None, "Blue. </think> x", (None, "Blue. </think> x")),
    ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False}, "<think>a</think>b", (None, "<think>a</think>b")),
    ("qwen3", "", None, "Still thinking, out of tok", ("Still thinking, out of tok", None)),
    ("deepseek_r1", "<｜Assistant｜><think>\n", None, "Hmm.\n</think>Blue.", ("Hmm.", "Blue.")),
    ("deepseek_r1", "", None, "<think>Hmm.</think>\n\nBlue.", ("Hmm.", "Blue.")),
    ("deepseek_v3", "", None, "<think>a</think>Blue.", (None, "<think>a</think>Blue.")),
    ("deepseek_v3", "", {"thinking": True}, "a</think>Blue.", ("a", "Blue.")),
    ("mistral", "", None, "[THINK]Hmm.[/THINK]Blue.", ("Hmm.", "Blue.")),
    ("mistral", "", None, "Blue [THINK] x", (None, "Blue [THINK] x")),
    ("seed_oss", "", None, "<seed:think>Hmm.</seed:think>Blue.", ("Hmm.", "Blue.")),
])
def test_split_whole_and_streamed_one_character_at_a_time(name, prompt, kwargs, text, want):
    split = REASONING_FORMATS[name].for_request(prompt, kwargs)
    parsed = parse_output(text, split, None)
    assert (parsed.reasoning, parsed.content) == want
    stream = OutputStream(split, None)
    deltas = [stream.delta(text[:k]) for k in range(1, len(text))] + [stream.finish(text)]
    assert "".join(d.reasoning for d in deltas) == (want[0] or "")
    assert "".join(d.content for d in deltas) == (want[1] or "")
    if want[0] is not None:  # no piece of a marker ever went out
        fmt = REASONING_FORMATS[name]
        assert all(fmt.start[:2] not in d.reasoning + d.content for d in deltas if d.reasoning or d.content)


def test_tool_calls_are_read_from_the_answer_only():
    split = QWEN3.for_request("", None)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = f"<think>\nMaybe {call} later.\n</think>\n\nChecking. {call}"
    parsed = parse_output(text, split, FORMATS["hermes"])
    assert parsed.reasoning == f"Maybe {call} later." and parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    stream = OutputStream(split, FORMATS["hermes"])
    deltas = [stream.delta(text[:k]) for k in range(1, len(text))] + [stream.finish(text)]
    assert "".join(d.reasoning for d in deltas) == parsed.reasoning
    assert "".join(d.content for d in deltas) == "Checking. "
    assert [c["function"]["name"] for c in deltas[-1].tool_calls] == ["get_weather"]


def test_where_the_output_begins():
    assert QWEN3.for_request("x<think>\n\n</think>\n\n", None).begin is Begin.CONTENT
    assert QWEN3.for_request("x<think>\n", {"enable_thinking": True}).begin is Begin.THINKING
    assert REASONING_FORMATS["mistral"].for_request("x", None).begin is Begin.EITHER
    assert R1.for_request("x", {"thinking": False}).begin is Begin.CONTENT
    assert not REASONING_FORMATS["mistral"].for_request("x", None).defers_grammar


def test_parser_names_and_config_errors():
    assert sorted(REASONING_FORMATS) == sorted(REASONING_PARSERS)
    assert reasoning_format(None) is None and reasoning_format("qwen3") is QWEN3
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        ServerConfig(reasoning_parser="deepseek-r2")


# ---- end to end -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(qwen3_chat_server):
    """Three apps over the shared engine (``tests/entrypoints/conftest.py``): the thinking forced
    by regex (grammar in the thinking), the default (grammar after it), and no reasoning parser."""
    path, engine, server = qwen3_chat_server
    return {"forced": server(reasoning_parser="qwen3", structured_outputs_in_reasoning=True),
            "deferred": server(reasoning_parser="qwen3"), "plain": server(), "model": path,
            "tokenizer": engine.tokenizer}


def _chat(server, servers, text=None, stream=False, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Name a colour."}])
    body = dict(kw.pop("extra_body", {}))
    if text is not None:
        body["structured_outputs"] = {"regex": exact_regex(text)}
    return servers[server].client().chat.completions.create(
        model=servers["model"], max_tokens=kw.pop("max_tokens", 80), temperature=0, stream=stream, extra_body=body, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_thinking_splits_exactly(servers, stream):
    text = "<think>\nThe user wants a colour.\n</think>\n\nBlue."
    out = _chat("forced", servers, text, stream)
    if stream:
        assert streamed(out)[:2] == ("The user wants a colour.", "Blue.")
    else:
        msg = out.choices[0].message
        assert (msg.reasoning_content, msg.content) == ("The user wants a colour.", "Blue.")
    plain = _chat("plain", servers, text).choices[0].message  # no parser: the text as written
    assert plain.content == text and getattr(plain, "reasoning_content", None) is None


@pytest.mark.parametrize("stream", [False, True])
def test_forced_thinking_then_a_tool_call(servers, stream):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    out = _chat("forced", servers, f"<think>\nI need the weather.\n</think>\n\n{call}", stream, tools=[WEATHER])
    if stream:
        reasoning, content, calls, finishes = streamed(out)
        assert (reasoning, content, finishes) == ("I need the weather.", "", ["tool_calls"])
    else:
        choice = out.choices[0]
        reasoning, content, finishes = choice.message.reasoning_content, choice.message.content, [choice.finish_reason]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
        assert (reasoning, content, finishes) == ("I need the weather.", None, ["tool_calls"])
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_switched_off_is_all_content(servers, stream):
    text = "I think </think> Blue."
    out = _chat("forced", servers, text, stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    if stream:
        assert streamed(out)[:2] == ("", text)
    else:
        assert (out.choices[0].message.reasoning_content, out.choices[0].message.content) == (None, text)


def test_grammar_starts_after_the_thinking(servers):
    end_id = servers["tokenizer"].convert_tokens_to_ids("</think>")
    schema = {"type": "object", "properties": {"colour": {"enum": ["blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    # The thinking ends at once (the bias); the answer then follows the schema exactly.
    out = _chat("deferred", servers, response_format=rf, logit_bias={str(end_id): 100}).choices[0].message
    assert (out.reasoning_content, out.content) == (None, '{"colour": "blue"}')
    # No end marker within max_tokens: all thinking, free of the schema.
    free = _chat("deferred", servers, response_format=rf, max_tokens=6,
                 extra_body={"logit_bias": {str(end_id): -100}}).choices[0].message
    assert free.content is None and free.reasoning_content and not free.reasoning_content.startswith('{"colour"')
    # Thinking switched off in the prompt: the schema holds from the first token.
    off = _chat("deferred", servers, response_format=rf, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == '{"colour": "blue"}'


def test_reasoning_effort_reaches_a_template_that_reads_it(servers):
    plain = _chat("plain", servers, max_tokens=1)
    effort = _chat("plain", servers, max_tokens=1, reasoning_effort="low")
    assert effort.usage.prompt_tokens > plain.usage.prompt_tokens
    r = httpx.post(servers["plain"].url + "/v1/chat/completions", timeout=60, json={
        "model": servers["model"], "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "huge"})
    assert_error(r, 400, "reasoning_effort")
