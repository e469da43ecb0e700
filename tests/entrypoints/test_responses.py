"""POST /v1/responses through the official openai client (``responses.create`` and
``responses.stream``): a tiny random model with a Qwen3-style template whose text a regex forces
exactly, read back as output items (message, function calls, reasoning), streamed as OpenAI's
events, and the 4xx answers of what a stateless server does not do."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers.chat_models import exact_regex
from tests.helpers.server import assert_error

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": CITY}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nThe user wants a colour.\n</think>\n\n"
KEY = "responses-key"


@pytest.fixture(scope="module")
def servers(qwen3_chat_server):
    """Over the shared engine (``tests/entrypoints/conftest.py``): a server with the qwen3
    reasoning parser (a regex forces the thinking too), one without, and one behind an API key."""
    path, _, server = qwen3_chat_server
    return {"thinking": server(reasoning_parser="qwen3", structured_outputs_in_reasoning=True),
            "plain": server(), "keyed": server(api_key=KEY), "model": path}


def _create(servers, forced=None, server="plain", **kw):
    """``responses.create`` greedy, the text ``forced`` by a regex."""
    kw.setdefault("input", "Name a colour.")
    body = dict(kw.pop("extra_body", {}))
    if forced is not None:
        body["structured_outputs"] = {"regex": exact_regex(forced)}
    return servers[server].client().responses.create(
        model=servers["model"], max_output_tokens=kw.pop("max_output_tokens", 80), temperature=0, extra_body=body, **kw)


def _stream(servers, forced, server="plain", **kw):
    """(every event, the final response) of ``responses.stream`` with the text ``forced``."""
    kw.setdefault("input", "Name a colour.")
    with servers[server].client().responses.stream(
            model=servers["model"], max_output_tokens=80, temperature=0,
            extra_body={"structured_outputs": {"regex": exact_regex(forced)}}, **kw) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def _items(response) -> list[tuple]:
    """Each output item as (type, its text or its call)."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(p.text for p in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(p.text for p in item.content)))
        else:
            out.append(("function_call", item.name, json.loads(item.arguments)))
    return out


def _chat_prompt_tokens(servers, messages, **kw) -> int:
    out = servers["plain"].client().chat.completions.create(model=servers["model"], messages=messages, max_tokens=1, **kw)
    return out.usage.prompt_tokens


# ---- output items ---------------------------------------------------------------------------------
def test_text_output_and_usage(servers):
    r = _create(servers, "Blue.")
    assert (r.object, r.status, r.model, r.output_text) == ("response", "completed", servers["model"], "Blue.")
    assert r.id.startswith("resp-") and r.incomplete_details is None and r.created_at > 0
    [message] = r.output
    assert (message.type, message.role, message.status, [p.type for p in message.content]) == \
           ("message", "assistant", "completed", ["output_text"])
    # The same prompt as the chat API builds; output tokens: the text's and the end-of-turn token.
    assert r.usage.input_tokens == _chat_prompt_tokens(servers, [{"role": "user", "content": "Name a colour."}])
    assert r.usage.output_tokens >= 2 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_and_message_items_build_the_chat_prompt(servers):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a "}, {"type": "input_text", "text": "colour."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Red.", "annotations": []}]},
             {"role": "developer", "content": "Another one."}]
    r = _create(servers, "Green.", input=items, instructions="Be brief.", metadata={"team": "a"}, store=True)
    assert r.output_text == "Green." and r.instructions == "Be brief." and r.metadata == {"team": "a"}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."}, {"role": "system", "content": "Another one."}]
    assert r.usage.input_tokens == _chat_prompt_tokens(servers, chat)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_a_function_call_item(servers, stream):
    text = f"Checking. {CALL}"
    if stream:
        _, r = _stream(servers, text, tools=[WEATHER])
    else:
        r = _create(servers, text, tools=[WEATHER])
    assert r.status == "completed"
    # Streamed, the space before the call went out before the call began (as in a chat stream).
    assert _items(r) == [("message", "Checking. " if stream else "Checking."),
                         ("function_call", "get_weather", {"city": "Paris"})]
    call = r.output[1]
    assert call.call_id.startswith("call_") and call.status == "completed" and call.arguments == '{"city": "Paris"}'
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"


def test_required_and_named_tool_choice_force_one_call(servers):
    choices = ("required", {"type": "function", "name": "get_weather"})
    with ThreadPoolExecutor(len(choices)) as pool:  # at once: one batch
        responses = list(pool.map(lambda choice: _create(servers, tools=[WEATHER], tool_choice=choice,
                                                         max_output_tokens=200), choices))
    for choice, r in zip(choices, responses):
        [call] = r.output
        assert (call.type, call.name, set(json.loads(call.arguments))) == ("function_call", "get_weather", {"city"}), choice


def test_function_call_output_items_continue_the_turn(servers):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C."}]
    r = _create(servers, "It is sunny.", input=items, tools=[WEATHER])
    assert r.output_text == "It is sunny."
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert r.usage.input_tokens == _chat_prompt_tokens(servers, chat, tools=tools)
    # Output items sent back as input (with their ids and statuses) are taken as they are.
    again = _create(servers, "Done.", input=[*items[:1], *[i.model_dump(exclude_none=True) for i in r.output],
                                              {"role": "user", "content": "Thanks."}])
    assert again.output_text == "Done."


def test_json_schema_text_format(servers):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}, "shade": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["colour", "shade"], "additionalProperties": False}
    r = _create(servers, text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}})
    parsed = json.loads(r.output_text)
    assert set(parsed) == {"colour", "shade"} and parsed["colour"] in ("red", "blue") and 0 <= parsed["shade"] <= 9
    assert r.text.format.type == "json_schema" and r.text.format.name == "colour"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_items_with_a_reasoning_parser(servers, stream):
    with ThreadPoolExecutor(1) as pool:  # the request without a parser runs beside it, in one batch
        no_parser = pool.submit(_create, servers, THOUGHT + "Blue.")
        if stream:
            _, r = _stream(servers, THOUGHT + "Blue.", server="thinking")
        else:
            r = _create(servers, THOUGHT + "Blue.", server="thinking")
        plain = no_parser.result()
    assert _items(r) == [("reasoning", "The user wants a colour."), ("message", "Blue.")]
    assert r.output_text == "Blue." and r.output[0].status == "completed"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert _items(plain) == [("message", THOUGHT + "Blue.")]


def test_reasoning_then_a_call(servers):
    r = _create(servers, f"{THOUGHT}{CALL}", server="thinking", tools=[WEATHER])
    assert _items(r) == [("reasoning", "The user wants a colour."), ("function_call", "get_weather", {"city": "Paris"})]


def test_reasoning_effort_reaches_a_template_that_reads_it(servers):
    plain = _create(servers, "Blue.")
    effort = _create(servers, "Blue.", reasoning={"effort": "low"})
    assert effort.usage.input_tokens > plain.usage.input_tokens and effort.reasoning.effort == "low"


@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_makes_it_incomplete(servers, stream):
    kw = dict(max_output_tokens=3, extra_body={"ignore_eos": True})
    if stream:
        events = list(_create(servers, stream=True, **kw))
        assert events[-1].type == "response.incomplete"
        r = events[-1].response
    else:
        r = _create(servers, **kw)
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert r.output[-1].status == "incomplete" and r.max_output_tokens == 3


# ---- streaming --------------------------------------------------------------------------------------
def _types(events) -> list[str]:
    """Event types, runs of one delta type folded into one entry."""
    out = []
    for e in events:
        if not (e.type.endswith(".delta") and out and out[-1] == e.type):
            out.append(e.type)
    return out


def test_streamed_text_events_in_order(servers):
    events, final = _stream(servers, "Blue, like the sky.")
    assert _types(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                              "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == "Blue, like the sky."
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == final.output_text and done.item_id == final.output[0].id
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "completed" and final.usage.output_tokens > 1


def test_streamed_reasoning_and_call_events_in_order(servers):
    events, final = _stream(servers, f"{THOUGHT}{CALL}", server="thinking", tools=[WEATHER])
    assert _types(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "The user wants a colour." == final.output[0].content[0].text
    args = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert (args.output_index, args.item_id, json.loads(args.arguments)) == (1, final.output[1].id, {"city": "Paris"})
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]


def test_sse_lines_name_each_event(servers):
    body = {"model": servers["model"], "input": "Name a colour.", "max_output_tokens": 8, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", servers["plain"].url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]
    assert blocks[-1].startswith("event: response.") and "[DONE]" not in blocks[-1]


# ---- what it refuses ----------------------------------------------------------------------------------
REFUSED = [
    ({"previous_response_id": "resp-1"}, "previous_response_id", "stateless"),
    ({"conversation": "conv-1"}, "conversation", "stateless"),
    ({"background": True}, "background", "stateless"),
    ({"input": [{"type": "web_search_call", "id": "ws-1"}]}, "input", "input items of type 'web_search_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input",
     "content parts of type 'input_file'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input", None),  # a text model (this one) or a bad image
    ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id"),
    ({"input": []}, "input", "at least one"),
    ({"input": 5}, "input", "string or a list"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools of type 'web_search'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "required"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "summary"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
    ({"truncation": "auto"}, "truncation", None),
    ({"max_output_tokens": 0}, "max_output_tokens", None),
    ({"temperature": -1}, "temperature", None),
    ({"n": 2}, "n", "unknown field"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unknown field"),
]


@pytest.mark.parametrize("body,param,words", REFUSED)
def test_refused_requests_are_400_naming_the_field(servers, body, param, words):
    r = httpx.post(servers["plain"].url + "/v1/responses", timeout=60,
                   json={"model": servers["model"], "input": "hi", "max_output_tokens": 2, **body})
    error = assert_error(r, 400, param)
    assert words is None or words in error["message"], error


def test_other_model_is_404_and_the_client_raises(servers):
    r = httpx.post(servers["plain"].url + "/v1/responses", json={"model": "gpt-5", "input": "hi"}, timeout=60)
    assert assert_error(r, 404, "model")["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="stateless"):
        _create(servers, previous_response_id="resp-1")


def test_behind_the_api_key(servers):
    url = servers["keyed"].url + "/v1/responses"
    body = {"model": servers["model"], "input": "hi", "max_output_tokens": 2}
    assert assert_error(httpx.post(url, json=body, timeout=60), 401)["code"] == "invalid_api_key"
    r = servers["keyed"].client(api_key=KEY).responses.create(**body)
    assert r.status in ("completed", "incomplete")
