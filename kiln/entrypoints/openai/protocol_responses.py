"""The Responses API's wire format (``POST /v1/responses``): the request (validated, then turned
into the chat request it runs as) and the response, its output items and usage.

Rules kept here, beside protocol.py's (every field declared, every string text, every number in
range):

- Stateless, as vLLM's first version: nothing is stored, so ``previous_response_id``,
  ``conversation`` and ``background: true`` are 400s that say so; ``store`` is accepted and
  ignored (vLLM's behaviour without a store: most clients send OpenAI's default, true).
- ``input`` is a string (one user message) or a list of items: messages (``input_text`` and
  ``input_image`` parts, the image by its URL as a chat ``image_url`` part; an assistant's
  ``output_text`` parts too, so a client can send earlier output back), the
  ``function_call`` items of earlier turns with their ``function_call_output`` results, and
  ``reasoning`` items, which are dropped (chat templates drop earlier thinking). Any other item,
  part or tool type is a 400 naming it.
- A request runs as a chat request (``chat_request``): ``instructions`` as its system message, the
  flat function tools as chat tools, ``text.format`` as ``response_format``,
  ``max_output_tokens`` as ``max_completion_tokens``, ``reasoning.effort`` as ``reasoning_effort``.
  kiln's extensions the chat request takes (``EXTENSIONS``: structured_outputs, top_k, ...) ride
  along under the same names.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kiln.entrypoints.openai.protocol import (
    MAX_INT32, ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, JsonObject,
    JsonSchemaFormat, NamedFunction, NamedToolChoice, ResponseFormat, Text, Tool, ToolCall, Unimplemented,
    _Request, _SamplingFields,
)

# Fields the Responses request takes as the chat request declares them (ranges and all), passed on.
EXTENSIONS = ("seed", "stop", "stop_token_ids", "top_k", "min_p", "repetition_penalty", "ignore_eos",
              "min_tokens", "priority", "structured_outputs")
# OpenAI's fields that change nothing about the tokens (protocol.IGNORED_FIELDS), echoed where OpenAI echoes them.
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
STATELESS = "kiln's /v1/responses is stateless (it stores no response or conversation)"


def _stateless(what: str) -> None:
    raise PydanticCustomError("not_implemented", "{stateless}, so {what}", {"stateless": STATELESS, "what": what})


class InputText(_Request):
    """A text part: ``input_text`` in a message, ``output_text`` in an assistant message sent back."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: Optional[list[Any]] = None  # an output_text's, as kiln sends them (always empty)
    logprobs: Optional[list[Any]] = None


class InputImage(_Request):
    """An image part: its URL (data:, or http(s): and file: where the server allows them), as a
    chat message's image_url part carries it."""

    type: Literal["input_image"]
    image_url: Optional[Text] = None
    file_id: Optional[Text] = None
    detail: Optional[Literal["auto", "low", "high"]] = None

    @model_validator(mode="after")
    def _url(self) -> "InputImage":
        if self.file_id is not None:
            _stateless("an input_image cannot name an uploaded file (`file_id`); send its `image_url`")
        if self.image_url is None:
            raise PydanticCustomError("content_type", "an input_image part has an `image_url` (a data:, http(s): "
                                      "or file: URL)")
        return self


PART_TYPES = {"input_text": InputText, "output_text": InputText, "input_image": InputImage}


def _parts(value: Any) -> Any:
    """Text and image parts pass, each validated as its type; a part of another type (files,
    refusals, audio) is a 400 naming its type."""
    if not isinstance(value, list):
        return value
    parts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise PydanticCustomError("not_implemented", "kiln does not implement content parts of type {kind}; "
                                      "send parts of type 'input_text' or 'input_image'", {"kind": ascii(kind)[:40]})
        parts.append(PART_TYPES[kind].model_validate(part))
    return parts


Content = Annotated[Union[Text, list[Union[InputText, InputImage]]], BeforeValidator(_parts)]


def _text(content: Union[str, list[Union[InputText, InputImage]]]) -> str:
    if isinstance(content, str):
        return content
    if any(isinstance(p, InputImage) for p in content):
        raise ValueError("an input_image part can only be in a message's content")
    return "".join(p.text for p in content)


def _chat_content(content: Union[str, list[Union[InputText, InputImage]]]) -> Union[str, list[dict]]:
    """A message's content as a chat message's: text, or text and image_url parts."""
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": p.image_url}} if isinstance(p, InputImage)
            else {"type": "text", "text": p.text} for p in content]


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: Optional[Text] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None


class FunctionCallItem(_Request):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text  # JSON text
    id: Optional[Text] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class FunctionCallOutputItem(_Request):
    """What the client's function returned for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Content
    id: Optional[Text] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ReasoningItem(_Request):
    """Earlier thinking sent back; accepted and dropped."""

    type: Literal["reasoning"]
    id: Optional[Text] = None
    summary: Optional[list[Any]] = None
    content: Optional[list[Any]] = None
    encrypted_content: Optional[Text] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem,
          "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


def _input(value: Any) -> Any:
    """Each item validated as its ``type`` says (a message may leave it out), so an error names the
    item and its field rather than every type the item is not."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("input_type", "must be a string or a list of input items")
    items = []
    for i, item in enumerate(value):
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind not in _ITEMS:
            raise PydanticCustomError("not_implemented", "kiln does not implement input items of type {kind} "
                                      "(input[{i}]); send message, function_call, function_call_output or "
                                      "reasoning items", {"kind": ascii(kind)[:40], "i": i})
        try:
            items.append(_ITEMS[kind].model_validate(item))
        except ValidationError as e:
            # The deepest error: a union's other members fail at its top (a list is no string).
            error = max(e.errors(), key=lambda err: len(err["loc"]))
            where = ".".join(str(p) for p in error["loc"] if "[" not in str(p))  # without union members' tags
            if error["type"] == "not_implemented":  # its message is shown as it is
                raise PydanticCustomError("not_implemented", "input[{i}].{where}: {msg}",
                                          {"i": i, "where": where, "msg": error["msg"]}) from None
            raise PydanticCustomError("invalid_item", "item {i} ({kind}), {where}: {msg}",
                                      {"i": i, "kind": kind, "where": where, "msg": error["msg"]}) from None
    return items


class ResponsesFunctionTool(FunctionDefinition):
    """The Responses API's function tool: the chat tool's function, flat, with its type."""

    type: Literal["function"]


def _tools(value: Any) -> Any:
    for tool in value if isinstance(value, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise PydanticCustomError("not_implemented", "kiln does not implement tools of type {kind}; "
                                      "send function tools", {"kind": ascii(kind)[:40]})
    return value


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: Text


class TextFormat(_Request):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[Text] = None
    description: Optional[Text] = None
    json_schema: Optional[JsonObject] = Field(None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("invalid_value", "type json_schema needs its `schema`")
        return self


class TextConfig(_Request):
    format: Optional[TextFormat] = None
    verbosity: Unimplemented = None


class ReasoningConfig(_Request):
    effort: ChatCompletionRequest.model_fields["reasoning_effort"].annotation = None
    summary: Unimplemented = None  # kiln returns the thinking itself, never a summary of it
    generate_summary: Unimplemented = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: Optional[bool] = None  # accepted, ignored: kiln pads no event


# The chat request's own declarations of the fields taken from it.
_Shared = create_model("_Shared", __base__=_Request, **{
    name: (field.annotation, field) for name, field in _SamplingFields.model_fields.items()
    if name in EXTENSIONS + IGNORED + ("model", "temperature", "top_p", "stream")})


class ResponsesRequest(_Shared):
    input: Annotated[Union[Text, list[InputItem]], BeforeValidator(_input)]
    instructions: Optional[Text] = None
    max_output_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32)
    tools: Annotated[Optional[list[ResponsesFunctionTool]], BeforeValidator(_tools)] = None
    tool_choice: Union[None, Literal["none", "auto", "required"], FunctionToolChoice] = None
    parallel_tool_calls: Optional[bool] = None  # accepted: a model may write several calls; a grammar asks one
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    stream_options: Optional[ResponsesStreamOptions] = None
    truncation: Optional[Literal["disabled"]] = None  # "auto" (drop old turns to fit) is not implemented
    # stateless: refused unless null (or false)
    previous_response_id: Optional[Text] = None
    conversation: Optional[Any] = None
    background: Optional[bool] = None
    # OpenAI fields kiln does not implement: refused unless null or asking for nothing
    include: Unimplemented = None
    top_logprobs: Unimplemented = None
    max_tool_calls: Unimplemented = None
    prompt: Unimplemented = None

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _no_earlier_state(cls, value: Any, info) -> Any:
        if value is not None:
            _stateless(f"`{info.field_name}` cannot name an earlier one; send the earlier turns in `input`")
        return value

    @field_validator("background")
    @classmethod
    def _not_in_background(cls, value: Optional[bool]) -> Optional[bool]:
        if value:
            _stateless("it cannot run a response in the background to be fetched later; leave `background` unset")
        return value

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this request runs as; ValueError (its ``input``) for an empty conversation."""
        messages = self.messages()
        if not messages:
            raise ValueError("input: give a string or at least one message item")
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = NamedToolChoice(function=NamedFunction(name=choice.name))
        effort = self.reasoning.effort if self.reasoning is not None else None
        return ChatCompletionRequest(
            messages=messages, max_completion_tokens=self.max_output_tokens, tool_choice=choice,
            tools=[Tool(function=FunctionDefinition(**t.model_dump(exclude={"type"}))) for t in self.tools or []] or None,
            response_format=self.response_format(), reasoning_effort=effort, parallel_tool_calls=self.parallel_tool_calls,
            **{name: getattr(self, name) for name in EXTENSIONS + ("model", "temperature", "top_p", "stream")})

    def response_format(self) -> Optional[ResponseFormat]:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else ResponseFormat(type=fmt.type)
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name or "response", description=fmt.description, schema=fmt.json_schema, strict=fmt.strict))

    def messages(self) -> list[ChatMessage]:
        """``instructions`` and ``input`` as chat messages: a call joins the assistant message
        before it (or opens one), a call's output is a tool message naming the function."""
        out = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        if isinstance(self.input, str):
            return out + [ChatMessage(role="user", content=self.input)]
        names: dict[str, str] = {}
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append(ChatMessage(role=item.role, content=_chat_content(item.content)))
            elif isinstance(item, FunctionCallItem):
                names[item.call_id] = item.name
                call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                if not out or out[-1].role != "assistant":
                    out.append(ChatMessage(role="assistant", content=None))
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            elif isinstance(item, FunctionCallOutputItem):
                out.append(ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id,
                                       name=names.get(item.call_id)))
        return out


# ---- the response -----------------------------------------------------------------------------
Status = Literal["completed", "incomplete", "in_progress"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class _Item(BaseModel):
    """What every output item has: an id (stable from its ``output_item.added`` on) and a status."""

    id: str
    status: Status = "in_progress"


class OutputMessage(_Item):
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputReasoning(_Item):
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class OutputFunctionCall(_Item):
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = Union[OutputReasoning, OutputMessage, OutputFunctionCall]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(BaseModel):
    """OpenAI's ``response``: the output and usage, and the settings it ran with, echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Status
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Optional[ResponsesUsage] = None
    incomplete_details: Optional[IncompleteDetails] = None
    error: None = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[dict] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: Optional[dict] = None
    metadata: Optional[dict] = None
    user: Optional[str] = None
    background: bool = False
    previous_response_id: None = None
    truncation: Literal["disabled"] = "disabled"
    store: bool = False  # nothing is stored, whatever the request said

    @classmethod
    def start(cls, response_id: str, model: str, body: ResponsesRequest) -> "ResponseObject":
        """The response before any output: the request's settings echoed, status in_progress."""
        return cls(
            id=response_id, status="in_progress", model=model, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
            tool_choice=(body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
                         else body.tool_choice or ("auto" if body.tools else "none")),
            parallel_tool_calls=body.parallel_tool_calls is not False,
            text=(body.text.model_dump(exclude_none=True, by_alias=True) if body.text is not None and body.text.format
                  else {"format": {"type": "text"}}),
            reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning is not None else None,
            metadata=body.metadata, user=body.user)
