"""Structured outputs and the OpenAI sampling surface, end to end: the embedded SmolLM2 behind a real
uvicorn server, driven by the official openai client; outputs checked with ``jsonschema`` and
``re``, unconstrained tokens against Hugging Face transformers.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from kiln import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers.server import SMOL, serve

S = {"type": "string", "maxLength": 16}
SCHEMAS = [  # increasing difficulty; every object strict (no extra keys), every string and array bounded
    {"type": "object", "properties": {"answer": S}, "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"is_sunny": {"type": "boolean"}}, "required": ["is_sunny"],
     "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
     "additionalProperties": False},
    {"type": "object", "properties": {"city": S, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"probability": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["probability"], "additionalProperties": False},
    {"type": "object", "properties": {"fruits": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["fruits"], "additionalProperties": False},
    {"type": "object", "properties": {"scores": {"type": "array", "minItems": 1, "maxItems": 4,
                                                 "items": {"type": "integer", "minimum": 0, "maximum": 100}}},
     "required": ["scores"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"name": S, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}},
     "required": ["person"], "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "subtitle": S, "pages": {"type": "integer", "minimum": 1,
                                                                             "maximum": 2000}},
     "required": ["title", "pages"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "animal"}, "legs": {"enum": [0, 2, 4, 6, 8]}},
     "required": ["kind", "legs"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"name": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "customer": {"type": "object", "properties": {"name": S, "vip": {"type": "boolean"}},
                     "required": ["name", "vip"], "additionalProperties": False}},
        "required": ["id", "customer"], "additionalProperties": False}}, "required": ["order"],
     "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [S, {"type": "integer", "minimum": 0, "maximum": 999}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 12},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
     "required": ["nickname", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                               "items": {"enum": ["news", "sport", "tech", "art"]}},
                                      "rating": {"type": "number", "minimum": 1, "maximum": 5}},
     "required": ["tags", "rating"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                                          "y": {"type": "integer", "minimum": -99, "maximum": 99}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"], "additionalProperties": False},
    {"type": "object", "properties": {"library": {"type": "object", "properties": {"books": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
            "title": S, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "authors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 2}},
            "required": ["title", "year", "authors"], "additionalProperties": False}}},
        "required": ["books"], "additionalProperties": False}}, "required": ["library"],
     "additionalProperties": False},
    {"type": "object", "properties": {
        "recipe": S, "difficulty": {"enum": ["easy", "medium", "hard"]},
        "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
        "steps": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 1, "maximum": 9}, "text": {"type": "string", "maxLength": 20}},
            "required": ["n", "text"], "additionalProperties": False}},
        "vegan": {"type": "boolean"}},
     "required": ["recipe", "difficulty", "minutes", "steps", "vegan"], "additionalProperties": False},
]
DEFAULT_SCHEMAS = [0, 7, 12, 17]  # one per difficulty band in the default suite; all 20 are `slow`


@pytest.fixture(scope="module")
def smol():
    server, engine = serve(SMOL, quantization="none")  # compared with transformers' float32 below
    yield server, engine
    server.stop()


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=smol[0].url + "/v1", api_key="unused", max_retries=0, timeout=900)


def _json_chat(client, schema: dict, **kw):
    kw = {"max_tokens": 160, "temperature": 0, **kw}
    return client.chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": "Reply with a short JSON example."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        **kw)


def _check_schemas(client, indices: list[int]) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(indices)) as pool:  # one batch: they decode together
        answers = list(pool.map(lambda i: _json_chat(client, SCHEMAS[i]), indices))
    for i, answer in zip(indices, answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])


def test_json_schemas_validate(client):
    _check_schemas(client, DEFAULT_SCHEMAS)


@pytest.mark.slow
def test_twenty_json_schemas_validate(client):
    _check_schemas(client, list(range(len(SCHEMAS))))


def test_json_schema_streamed_with_n_samples(client):
    chunks = _json_chat(client, SCHEMAS[8], n=3, temperature=1.0, seed=7, stream=True)
    texts = ["", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[8])


@pytest.mark.slow
def test_json_object(client):
    out = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Give a JSON object."}],
                                         max_tokens=80, temperature=0, response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_regex_and_choice_always_match(client):
    pattern = r"[0-9]{3}-[0-9]{4}"
    out = client.completions.create(model=SMOL, prompt="Call me at", max_tokens=20, n=4, temperature=1.0, seed=3,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) for c in out.choices), [c.text for c in out.choices]
    choices = ["yes", "no", "maybe later"]
    out = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Will it rain?"}],
                                         max_tokens=10, n=4, temperature=1.5, seed=5,
                                         extra_body={"guided_choice": choices})  # vLLM's older name
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in out.choices)


def test_grammar_and_stop_strings(client):
    grammar = 'root ::= ("red" | "green" | "blue") ", " [a-z]+'
    out = client.completions.create(model=SMOL, prompt="Pick a colour:", max_tokens=12, temperature=0,
                                    extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch("(red|green|blue), [a-z]+", out.choices[0].text), out.choices[0].text
    out = client.completions.create(model=SMOL, prompt="Say:", max_tokens=12, temperature=0, stop=["b"],
                                    extra_body={"structured_outputs": {"grammar": 'root ::= ("ab")+ "!"'}})
    assert out.choices[0].text == "a" and out.choices[0].finish_reason == "stop"  # cut at the stop string
    with pytest.raises(openai.BadRequestError, match="grammar"):
        client.completions.create(model=SMOL, prompt="x", max_tokens=2,
                                  extra_body={"structured_outputs": {"grammar": grammar + " ::="}})


def test_unconstrained_greedy_is_hf_greedy_beside_constrained_requests(smol, client):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import torch

    engine = smol[1]
    prompt = "The capital of France is"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        constrained = [pool.submit(_json_chat, client, SCHEMAS[4]), pool.submit(_json_chat, client, SCHEMAS[6])]
        plain = pool.submit(client.completions.create, model=SMOL, prompt=prompt, max_tokens=16, temperature=0,
                            extra_body={"return_token_ids": True}).result()
        for f in constrained:
            f.result()
    hf_dir = engine.tokenizer.name_or_path
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    want = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    assert plain.choices[0].token_ids == want
    # Prompt logprobs (echo + logprobs, and vLLM's prompt_logprobs) against HF's over the same prompt.
    with torch.no_grad():
        hf = model(ids).logits[0].float().log_softmax(-1)  # [prompt, vocab]
    hf_prompt = hf[:-1].gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()
    echo = client.completions.create(model=SMOL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2,
                                     extra_body={"prompt_logprobs": 1})
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(prompt) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:len(hf_prompt) + 1] == pytest.approx(hf_prompt, abs=2e-3)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:len(hf_prompt) + 1])
    # Embeddings: HF's final (normed) hidden states, last token and mean, normalized.
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0].float()  # [prompt, hidden]
    got = client.embeddings.create(model=SMOL, input=[prompt, "Another input"])
    want_last = torch.nn.functional.normalize(hidden[-1], dim=0)
    assert len(got.data) == 2 and got.usage.prompt_tokens > ids.shape[1]
    assert got.data[0].embedding == pytest.approx(want_last.tolist(), abs=2e-3)
    mean = client.embeddings.create(model=SMOL, input=prompt, extra_body={"pooling": "mean"}).data[0].embedding
    assert mean == pytest.approx(torch.nn.functional.normalize(hidden.mean(0), dim=0).tolist(), abs=2e-3)
    vllm_shape = echo.choices[0].model_extra["prompt_logprobs"]
    assert vllm_shape[0] is None and len(vllm_shape) == ids.shape[1]
    assert vllm_shape[1][str(ids[0, 1].item())]["logprob"] == pytest.approx(hf_prompt[0], abs=2e-3)


def test_bad_schema_is_400_saying_why(client):
    for schema, reason in (({"type": "nonsense"}, "nonsense"), ({"$ref": "#/$defs/missing"}, "missing")):
        with pytest.raises(openai.BadRequestError) as exc:
            _json_chat(client, schema)
        assert reason in exc.value.body["message"] and "structured_outputs" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="one output constraint"):
        _json_chat(client, SCHEMAS[0], extra_body={"guided_regex": "a+"})


def test_logit_bias_forces_a_token_and_min_tokens_holds_back_eos(smol, client):
    tokenizer = smol[1].tokenizer
    token = tokenizer.encode(" banana")[0]
    out = client.completions.create(model=SMOL, prompt="Hello", max_tokens=4, temperature=0.7, seed=1,
                                    logit_bias={str(token): 100}, extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == [token] * 4
    messages = [{"role": "user", "content": "Reply with the single word OK."}]
    short = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=60, temperature=0)
    assert short.choices[0].finish_reason == "stop"  # EOS after k tokens
    k = short.usage.completion_tokens
    held = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=k + 12, temperature=0,
                                          extra_body={"min_tokens": k + 6})
    assert held.usage.completion_tokens >= k + 6
    # Stop strings wait for min_tokens too (vLLM's rule): the first one that ends after token m counts.
    prompt, m = "1, 2, 3,", 5
    full = client.completions.create(model=SMOL, prompt=prompt, max_tokens=20, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
    before_m = len(tokenizer.decode(full.token_ids[:m]))
    assert full.finish_reason == "length" and "," in full.text[:before_m] and "," in full.text[before_m:]
    for min_tokens, want in ((0, full.text[:full.text.index(",")]), (m, full.text[:full.text.index(",", before_m)])):
        out = client.completions.create(model=SMOL, prompt=prompt, max_tokens=20, temperature=0, stop=[","],
                                        extra_body={"min_tokens": min_tokens}).choices[0]
        assert (out.text, out.finish_reason) == (want, "stop"), min_tokens


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model=SMOL, prompt="Hi", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage is not None for c in chunks)


def test_llm_api_constraints_survive_preemption():
    """A pool too small for the batch preempts requests mid-JSON; their matchers roll back or are
    rebuilt from their tokens, and every output still validates."""
    llm = LLM(SMOL, max_model_len=512, cache={"num_blocks": 14, "block_size": 16})
    schema = SCHEMAS[11]
    params = SamplingParams(max_tokens=100, temperature=0.8, seed=11, n=3,
                            structured_outputs=StructuredOutputsParams(json=schema))
    outs = llm.chat([[{"role": "user", "content": f"JSON list number {i}."}] for i in range(2)], params,
                    use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)


# ---- tool calling ---------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _streamed_calls(chunks) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish reason) accumulated from streamed deltas, as OpenAI clients do."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(client, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=SMOL, tools=[WEATHER, CLOCK], max_tokens=60, temperature=0)
    first = client.chat.completions.create(messages=messages, stream=stream, **kw,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        content, calls, finish = _streamed_calls(first)
    else:
        choice = first.choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
    assert finish == "tool_calls" and not content and len(calls) == 1 and calls[0]["id"]
    assert calls[0]["name"] == "get_weather" and isinstance(json.loads(calls[0]["arguments"])["city"], str)
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": calls[0]["id"], "type": "function",
                      "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Sunny, 21 degrees."}]
    answer = client.chat.completions.create(messages=messages, stream=stream, tool_choice="none", **kw)
    content, calls, finish = _streamed_calls(answer) if stream else (
        answer.choices[0].message.content, answer.choices[0].message.tool_calls or [], answer.choices[0].finish_reason)
    assert content and not calls and finish in ("stop", "length")


def test_tool_choice_required_and_bad_choices(client):
    out = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "What time is it?"}],
                                         tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=60, temperature=0)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls[0].function.name in ("get_weather", "get_time")
    json.loads(calls[0].function.arguments)
    for kw in (dict(tool_choice="required"), dict(tools=[WEATHER], tool_choice={"type": "function",
                                                                               "function": {"name": "nope"}})):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "x"}], max_tokens=2, **kw)
        assert exc.value.body["param"] == "tool_choice"
    # A parameters schema xgrammar cannot enforce: its reason, without the C++ logger's time and file.
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wat"}}}}}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       tools=[odd], tool_choice="required")
    message = exc.value.body["message"]
    assert exc.value.body["param"] == "tools" and "wat" in message and ".cc:" not in message and "\n" not in message


# ---- /tokenize and /detokenize ----------------------------------------------------------------------
def test_tokenize_and_detokenize(smol):
    import httpx

    server, engine = smol
    ids = engine.tokenizer.encode("Hello world")
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == engine.max_model_len
    assert r["token_strs"] == engine.tokenizer.convert_ids_to_tokens(ids)
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                tokenize=False)
    assert chat["tokens"] == engine.tokenizer.encode(text, add_special_tokens=False)
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 9]}).status_code == 400
