"""The OpenAI wire format: request bodies (validated) and response bodies (built by the handlers).

Requests keep OpenAI's field names. Rules kept here, so that no request body can reach the engine
with a value it cannot run:

- Every field is declared; a field nobody defines gets a 400 (``extra="forbid"``). A field OpenAI
  defines but kiln does not implement (``suffix``, ``audio``, ``prediction``, ...) gets a 400
  that names it, unless it is null or the value that asks for nothing (``suffix: ""``). Fields that change nothing about the answer (``user``,
  ``metadata``, ``store``, ``service_tier``, ...: ``IGNORED_FIELDS``) are accepted and ignored.
- Every number has a range the engine runs safely: NaN and infinity are refused, token ids are in
  [0, 2**31) (the engine then checks them against the vocabulary), seeds are signed 64-bit.
- Every string can be encoded as UTF-8 (no lone surrogate), since the tokenizer, the stop-string
  matcher and the response encoder all need that.
- Text is text: control tokens typed in a prompt or a message are tokenized as characters
  (``kiln.entrypoints.prompt_encoder``); a completion may opt in with ``parse_special_tokens``.

kiln's extensions (vLLM's names) ride along as extra body fields: top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output, priority,
return_token_ids, min_tokens, skip_special_tokens, prompt_logprobs, structured_outputs (vLLM's current name:
``{"json" | "json_object" | "regex" | "choice" | "grammar": ...}``; its older guided_json,
guided_regex, guided_choice and guided_grammar are accepted too), parse_special_tokens
(completions), add_generation_prompt, continue_final_message and chat_template_kwargs (chat; the
template's variables, every string in them marked as user text), use_beam_search, length_penalty and
early_stopping (a beam search of best_of beams on completions, n on chat, returning the n best:
``serving_beam_search.py``). A schema error becomes a 400 whose
``param`` names the field (errors.py).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, ValidationInfo, field_validator,
)
from pydantic_core import PydanticCustomError

from kiln.sampling_params import (
    MAX_LENGTH_PENALTY, SEED_MAX, SEED_MIN, SamplingParams, StructuredOutputsParams,
)

MAX_TOKEN_ID = (1 << 31) - 1  # the schema's bound; the engine refuses ids past the vocabulary
MAX_INT32 = (1 << 31) - 1
MAX_LOGPROBS = 20


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "invalid_text", "is not valid Unicode text: {reason} at character {start}; send text without "
            "lone surrogates", {"reason": e.reason, "start": e.start}) from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def _stop(value: Any) -> Union[None, str, list[str]]:
    if value is None or isinstance(value, str):
        return value if value is None else _utf8(value)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise PydanticCustomError("stop_type", "must be a string or a list of strings")
    return [_utf8(s) for s in value]


Stop = Annotated[Union[None, str, list[str]], BeforeValidator(_stop)]


def _utf8_all(value: Any) -> Any:
    """``value``, a JSON value, once every string inside it (keys too) encodes as UTF-8."""
    if isinstance(value, str):
        _utf8(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _utf8(k)
            _utf8_all(v)
    elif isinstance(value, list):
        for v in value:
            _utf8_all(v)
    return value


# A JSON object from the request (a schema, a tool's parameters): its strings are text too, so a
# lone surrogate deep inside is a 400 naming the field, not an error of whatever reads it later.
JsonObject = Annotated[dict[str, Any], AfterValidator(_utf8_all)]


# Names chat_template_kwargs may not set: apply_chat_template's own parameters and the variables it
# fills from the request (a template's tokens, such as bos_token, may be set: they are marked as text).
TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


# OpenAI fields kiln does not implement (declared as ``Unimplemented`` where OpenAI has them), each
# with the values that, like null, ask for nothing and so pass; any other value is a 400 naming it.
UNIMPLEMENTED_FIELDS: dict[str, tuple] = {
    "suffix": ("",),  # completions
    "dimensions": (),  # embeddings
    "functions": ([],), "function_call": ("none",),  # OpenAI's deprecated names: use tools, tool_choice
    "modalities": (["text"],), "audio": (), "prediction": (),
    "web_search_options": (), "verbosity": (),
    "refusal": (),  # on a message
    # responses (protocol_responses.py)
    "include": ([],), "top_logprobs": (0,), "max_tool_calls": (), "prompt": (), "summary": (), "generate_summary": (),
}


def _refuse_unimplemented(value: Any, info: ValidationInfo) -> None:
    if value is None or any(value == v for v in UNIMPLEMENTED_FIELDS[info.field_name]):
        return None
    raise PydanticCustomError("not_implemented", "kiln does not implement `{field}`; remove it from the request",
                              {"field": info.field_name})


Unimplemented = Annotated[Any, BeforeValidator(_refuse_unimplemented)]


# Accepted and ignored: none of them changes the tokens kiln generates.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                  "parallel_tool_calls")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far
    include_obfuscation: Optional[bool] = None  # accepted, ignored: kiln pads no stream chunk


class JsonSchemaFormat(_Request):
    name: Text = "response"
    description: Optional[Text] = None
    json_schema: Optional[JsonObject] = Field(None, alias="schema")
    # Accepted; the schema is enforced either way (as in vLLM), objects taking only their listed
    # properties unless additionalProperties says otherwise (kiln.runtime.structured_output).
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    json_: Union[None, JsonObject, Text] = Field(None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[Text] = None
    choice: Optional[list[Text]] = None
    grammar: Optional[Text] = None
    disable_any_whitespace: Optional[bool] = None  # accepted: kiln's JSON grammars are compact anyway


def _logit_bias(value: Any) -> Optional[dict[int, float]]:
    """OpenAI sends token ids as strings (JSON object keys); values in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PydanticCustomError("logit_bias", "must be an object mapping token ids to numbers in [-100, 100]")
    out = {}
    for k, v in value.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise PydanticCustomError("logit_bias", "keys must be token ids (integers), got {key}",
                                      {"key": ascii(k)[:40]}) from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (-100 <= v <= 100) or v != v:
            raise PydanticCustomError("logit_bias", "values must be numbers in [-100, 100], got {value}",
                                      {"value": ascii(v)[:40]})
        if not 0 <= token <= MAX_TOKEN_ID:
            raise PydanticCustomError("logit_bias", "token ids must be in [0, {limit}]", {"limit": MAX_TOKEN_ID})
        out[token] = float(v)
    return out


LogitBias = Annotated[Optional[dict[int, float]], BeforeValidator(_logit_bias)]


class _SamplingFields(_Request):
    """Fields that completions and chat share; both map them onto SamplingParams."""

    model: Optional[Text] = None  # None: the served model
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stop: Stop = None
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: LogitBias = None
    response_format: Optional[ResponseFormat] = None
    # accepted and ignored (IGNORED_FIELDS)
    user: Optional[Text] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[Text] = None
    prompt_cache_key: Optional[Text] = None
    safety_identifier: Optional[Text] = None
    # kiln extensions (vLLM's names)
    top_k: Optional[int] = Field(None, ge=-1, le=MAX_INT32)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # Bounded well inside float32: near 0 or huge, penalized logits overflow to inf and sampling to NaN.
    repetition_penalty: float = Field(1.0, ge=0.01, le=100.0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-MAX_INT32 - 1, le=MAX_INT32)
    return_token_ids: bool = False  # each choice (or chunk) also carries its generated token ids
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # per prompt token: its own and the top-N
    structured_outputs: Optional[StructuredOutputsRequest] = None
    # vLLM's older names for structured_outputs (still what many clients send)
    guided_json: Union[None, JsonObject, Text] = None
    guided_regex: Optional[Text] = None
    guided_choice: Optional[list[Text]] = None
    guided_grammar: Optional[Text] = None
    # vLLM's beam search; early_stopping is transformers' (false, true or "never")
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: Union[bool, Literal["never"]] = False

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The one output constraint asked for (response_format, structured_outputs or a guided_*
        field); ValueError naming the fields when several are set."""
        asked: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            asked.append(("response_format", StructuredOutputsParams(json=rf.json_schema.json_schema)))
        so = self.structured_outputs
        if so is not None:
            asked.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, json_object=bool(so.json_object), regex=so.regex, choice=so.choice,
                grammar=so.grammar)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, StructuredOutputsParams(**{kind: value})))
        if len(asked) > 1:
            raise ValueError(f"structured_outputs: give one output constraint, got {[n for n, _ in asked]}")
        return asked[0][1] if asked else None

    def sampling_params(self, max_tokens: Optional[int], num_logprobs: Optional[int],
                        structured_outputs: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError for combinations it refuses.
        ``structured_outputs``: a constraint the handler adds (tool calling), else the request's own."""
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            # OpenAI's default temperature is 1; beam search samples nothing, so its default is 0.
            temperature=(0.0 if self.use_beam_search else 1.0) if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=num_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias or None,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs or self.structured_outputs_params(),
            prompt_logprobs=self.num_prompt_logprobs,
            best_of=getattr(self, "best_of", None),  # a completions field: chat searches n beams
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )

    @property
    def num_prompt_logprobs(self) -> Optional[int]:
        return self.prompt_logprobs

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every stream chunk carries the usage so far (vLLM's stream_options.continuous_usage_stats)."""
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


def _prompt(value: Any) -> Union[str, list[int], list[str], list[list[int]]]:
    """OpenAI's four prompt shapes, each checked as a whole, so an error names what is wrong."""
    if isinstance(value, str):
        return _utf8(value)
    if not isinstance(value, list):
        raise PydanticCustomError("prompt_type", "must be a string, a list of strings, a list of token ids "
                                  "or a list of lists of token ids")
    if all(isinstance(p, str) for p in value):
        return [_utf8(p) for p in value]
    if all(isinstance(p, list) for p in value):
        return [_token_ids(p) for p in value]
    return _token_ids(value)


def _token_ids(ids: list) -> list[int]:
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise PydanticCustomError("token_ids", "token ids must be integers in [0, {limit}]", {"limit": MAX_TOKEN_ID})
    return ids


CompletionPrompt = Annotated[Any, BeforeValidator(_prompt)]


class CompletionRequest(_SamplingFields):
    prompt: CompletionPrompt
    max_tokens: Optional[int] = Field(16, ge=1, le=MAX_INT32)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # best_of >= n candidates, the n best returned: beams with use_beam_search, else samples ranked
    # by their cumulative logprob
    best_of: Optional[int] = Field(None, ge=1, le=128)
    suffix: Unimplemented = None
    # kiln extension: special-token strings in the prompt become those tokens (default: text)
    parse_special_tokens: bool = False

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, best_of: Optional[int], info: ValidationInfo) -> Optional[int]:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise PydanticCustomError("invalid_value", "must be at least n (got best_of={best_of}, n={n}): the n "
                                      "returned are the best of best_of", {"best_of": best_of, "n": n})
        return best_of

    @property
    def num_prompt_logprobs(self) -> Optional[int]:
        """``echo`` with ``logprobs`` scores the echoed prompt too (OpenAI's legacy behaviour)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per engine request: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


def _content(value: Any) -> Union[None, str, list[dict]]:
    """A message's content: a string, or a list of text parts (joined); with image_url parts, the
    list of text and image parts (read by ``kiln.entrypoints.media``); other parts are refused."""
    if value is None or isinstance(value, str):
        return value if value is None else _utf8(value)
    if not isinstance(value, list):
        raise PydanticCustomError("content_type", "must be a string or a list of content parts")
    texts = []
    parts: list[dict] = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            spec = part.get("image_url")
            if set(part) - {"type", "image_url"} or not isinstance(spec, dict) or not isinstance(spec.get("url"), str) \
                    or set(spec) - {"url", "detail"}:
                raise PydanticCustomError("content_type", "an image_url part is {\"type\": \"image_url\", "
                                          "\"image_url\": {\"url\": <data:, http(s): or file: URL>}}")
            parts.append({"type": "image_url", "image_url": {"url": spec["url"]}})
            continue
        if kind != "text":
            shown = ascii(kind)[:40]  # the type as a client sent it, safe to echo
            raise PydanticCustomError("not_implemented", "kiln does not implement content parts of type {kind}; "
                                      "send parts of type 'text' or 'image_url'", {"kind": shown})
        if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
            raise PydanticCustomError("content_type", "a text part has a string `text` and no other field")
        texts.append(_utf8(part["text"]))
        parts.append({"type": "text", "text": texts[-1]})
    return parts if any(p["type"] == "image_url" for p in parts) else "".join(texts)


class FunctionCall(_Request):
    name: Text
    arguments: Text = "{}"  # JSON text


class ToolCall(_Request):
    id: Optional[Text] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    # developer is OpenAI's newer name for system; tool messages answer an assistant's tool_calls.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Union[None, str, list[dict]], BeforeValidator(_content)] = None
    name: Optional[Text] = None  # the template may use it
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[Text] = None  # a tool message: the call it answers
    function_call: Unimplemented = None
    audio: Unimplemented = None
    refusal: Unimplemented = None


class FunctionDefinition(_Request):
    name: Annotated[str, AfterValidator(_utf8), Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Optional[Text] = None
    parameters: Optional[JsonObject] = None  # a JSON schema of the arguments
    strict: Optional[bool] = None  # the schema is enforced when tool_choice requires a call


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[None, Literal["none", "auto", "required"], NamedToolChoice] = None
    # OpenAI fields kiln does not implement: refused unless null or asking for nothing.
    functions: Unimplemented = None
    function_call: Unimplemented = None
    modalities: Unimplemented = None
    audio: Unimplemented = None
    prediction: Unimplemented = None
    web_search_options: Unimplemented = None
    verbosity: Unimplemented = None
    # Reaches the chat template as its variable ``reasoning_effort`` where the template reads one
    # (gpt-oss, ...); a template without it gets a 400.
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    parallel_tool_calls: Optional[bool] = None  # accepted: a model may write several calls; a grammar asks one
    # vLLM's chat template controls: the assistant turn's opening (default on), or the last
    # message continued in place (its turn left open; the opening then defaults to off), and more
    # of the template's own variables (``{"enable_thinking": false}`` for Qwen3's).
    add_generation_prompt: Optional[bool] = None
    continue_final_message: bool = False
    chat_template_kwargs: Optional[Annotated[dict[str, JsonValue], AfterValidator(_utf8_all)]] = None

    @field_validator("continue_final_message")
    @classmethod
    def _one_open_turn(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise PydanticCustomError("invalid_value", "continues the last message; it cannot also open a new "
                                      "assistant turn: set add_generation_prompt to false")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: Optional[dict]) -> Optional[dict]:
        for key in value or {}:
            if key in TEMPLATE_RESERVED:
                raise PydanticCustomError("invalid_value", "`{key}` is set by the server (from the messages, tools "
                                          "and generation fields); remove it", {"key": key})
        return value

    @property
    def opens_assistant_turn(self) -> bool:
        """add_generation_prompt as rendered: on unless the last message is continued."""
        return self.add_generation_prompt if self.add_generation_prompt is not None else not self.continue_final_message

    @property
    def effective_tool_choice(self) -> Union[str, NamedToolChoice]:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_dicts(self) -> list[dict]:
        """The functions, as templates and grammars read them (name, description, parameters)."""
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def check_tools(self) -> None:
        """ValueError (naming the field) for a tool_choice the tools cannot satisfy."""
        choice = self.effective_tool_choice
        names = [t.function.name for t in self.tools or []]
        if choice == "required" and not names:
            raise ValueError("tool_choice: `required` needs at least one tool in `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: names the function {choice.function.name!r}, which `tools` does not define")
        if choice not in ("none", "auto") and self.structured_outputs_params() is not None:
            raise ValueError("tool_choice: a required or named tool call cannot be combined with response_format "
                             "or structured_outputs")

    def conversation(self) -> list[dict]:
        """Messages as the chat template expects them (developer as system; a call's arguments as
        an object, as templates write them with tojson)."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                   for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---- responses ----------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# vLLM's prompt_logprobs: per prompt token (None for the first) {token id: {logprob, decoded_token}}
PromptLogprobsOut = Optional[list[Optional[dict[str, dict[str, Any]]]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids
    prompt_logprobs: PromptLogprobsOut = None  # with prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: Optional[str] = None
    reasoning_content: Optional[str] = None  # with server.reasoning_parser: the model's thinking
    content: Optional[str] = None
    tool_calls: Optional[list[dict]] = None  # OpenAI's shape: id, type, function {name, arguments}; index in deltas


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsOut = None  # with prompt_logprobs


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kiln"
    max_model_len: Optional[int] = None
    root: Optional[str] = None  # an adapter's directory
    parent: Optional[str] = None  # an adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoraAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's fields)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: Optional[str] = None  # load: a PEFT adapter directory on the server


# ---- /v1/embeddings ------------------------------------------------------------------------------
class EmbeddingRequest(_Request):
    model: Optional[Text] = None
    input: CompletionPrompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Unimplemented = None
    user: Optional[Text] = None
    pooling: Literal["last", "mean"] = "last"  # kiln extension: last token's hidden state, or the mean

    def inputs(self) -> list[Union[str, list[int]]]:
        p = self.input
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        return list(p)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo


# ---- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------------
class TokenizeRequest(_Request):
    """Either ``prompt`` (text) or ``messages`` (rendered by the chat template first)."""

    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    tools: Optional[list[Tool]] = None
    add_special_tokens: Optional[bool] = None  # default: true for a prompt, false for messages
    # messages only, as a chat request takes them
    add_generation_prompt: Optional[bool] = None
    continue_final_message: bool = False
    chat_template_kwargs: Optional[Annotated[dict[str, JsonValue], AfterValidator(_utf8_all)]] = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: Optional[int] = None
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(_Request):
    model: Optional[Text] = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
