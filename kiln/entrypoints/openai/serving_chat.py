"""POST /v1/chat/completions: the tokenizer's chat template turns the messages into one prompt.

The prompt is rendered (with the assistant turn opened, unless the request continues its last
message: ``add_generation_prompt``, ``continue_final_message``) and tokenized by the ``PromptEncoder``:
control tokens the template writes are control tokens, those typed in a message are text, so no
message can forge a turn. A stream opens with one chunk per choice that carries
``role: "assistant"``; content deltas follow, the last carrying the finish reason.

With ``tools`` the template renders them (or, for a template without tools, a system message does:
``tool_calls.py``); calls the model writes come back as ``tool_calls`` (finish reason
``tool_calls``), and ``tool_choice`` ``required`` or a named function constrains the output to one
call with a grammar.

With ``server.reasoning_parser`` the thinking comes back as ``reasoning_content`` (``reasoning.py``);
tool calls and content are read from the answer after it (``output_parser.py``), and a grammar
(structured outputs, a forced call) starts after the thinking's end marker unless
``server.structured_outputs_in_reasoning``. ``reasoning_effort`` reaches a template that reads it.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kiln.entrypoints.beam_search import ranks_outputs
from kiln.entrypoints.media import MediaError, MediaPolicy, split_image_parts
from kiln.entrypoints.openai.errors import bad_request
from kiln.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, NamedToolChoice, TopLogprob, UsageInfo,
)
from kiln.entrypoints.openai.serving import (
    SSE_DONE, ServingContext, TimedStream, api_error, new_id, prompt_logprobs_out, respond_when_done,
    sampling_params_or_400, sse,
)
from kiln.entrypoints.openai.output_parser import OutputStream, parse_output
from kiln.entrypoints.openai.serving_beam_search import refuse_stream, run_ranked
from kiln.entrypoints.openai.reasoning import ReasoningSplit, reasoning_format
from kiln.entrypoints.openai.tool_calls import ToolFormat, choose_format, template_renders_tools, tools_as_text
from kiln.errors import first_line
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.runtime.input_processor import TokenizedPrompt
from kiln.runtime.structured_output import xgrammar_reason


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw: Request) -> Response:
    chat = prepare_chat(ctx, body)
    request_id = new_id("chatcmpl")
    if ranks_outputs(chat.params):  # beam search of n beams: answered once every beam is done
        refuse_stream(chat.params, body.stream)
        ranked = run_ranked(ctx, request_id, [chat.prompt], chat.params, body.priority, add_special_tokens=False,
                            prompt_param="messages", lora=ctx.lora_for(body.model))
        return await respond_when_done(raw, request_id, ranked, lambda finals: _response(
            ctx, body, request_id, finals[0], chat.fmt, chat.reasoning))
    streams = await ctx.start(request_id, [chat.prompt], chat.params, body.priority, add_special_tokens=False,
                              prompt_param="messages", lora=ctx.lora_for(body.model))
    if body.stream:
        return StreamingResponse(_stream(ctx, body, request_id, streams[0], chat.fmt, chat.reasoning),
                                 media_type="text/event-stream")
    return await respond_when_done(raw, request_id, collect(streams[0]),
                                   lambda final: _response(ctx, body, request_id, final, chat.fmt, chat.reasoning))


@dataclasses.dataclass
class PreparedChat:
    """What running a chat request takes: its prompt, its sampling params and how its text is read."""

    prompt: TokenizedPrompt
    params: SamplingParams
    fmt: Optional[ToolFormat]  # None: no tool calls are read
    reasoning: Optional[ReasoningSplit]  # None: no reasoning parser
    tools: Optional[list[dict]]  # the functions calls are read against (with ``fmt``)


def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest) -> PreparedChat:
    """Checks (400s), the rendered prompt and the sampling params of a chat request (also the one
    a Responses request runs as)."""
    ctx.check(body.model)
    try:
        body.check_tools()
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from e
    fmt = _tool_format(ctx, body)
    prompt = _render(ctx, body, fmt)
    reasoning = _reasoning(ctx, body, prompt)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    call_grammar = _call_grammar(body, fmt)
    params = sampling_params_or_400(lambda: body.sampling_params(max_tokens, num_logprobs, call_grammar))
    _parse_ready(ctx, params, reasoning, fmt)
    return PreparedChat(prompt, params, fmt, reasoning, body.tool_dicts() if fmt is not None else None)


def _tool_format(ctx: ServingContext, body: ChatCompletionRequest) -> Optional[ToolFormat]:
    """The format tool calls are written in, or None when this request calls no tools."""
    if body.effective_tool_choice == "none":
        return None
    return choose_format(ctx.server.tool_call_parser, getattr(ctx.engine.tokenizer, "chat_template", None))


def _reasoning(ctx: ServingContext, body: ChatCompletionRequest, prompt: TokenizedPrompt) -> Optional[ReasoningSplit]:
    """How this request's output splits into thinking and answer; None without a reasoning parser."""
    fmt = reasoning_format(ctx.server.reasoning_parser)
    return fmt.for_request(prompt.text, body.chat_template_kwargs) if fmt is not None else None


def _parse_ready(ctx: ServingContext, params: SamplingParams, reasoning: Optional[ReasoningSplit],
                 fmt: Optional[ToolFormat]) -> None:
    """``params`` made fit for parsing: the grammar waits for the thinking's end marker, and markers
    that are special tokens stay in the text."""
    tokenizer = ctx.engine.tokenizer
    so = params.structured_outputs
    if so is not None and reasoning is not None and reasoning.defers_grammar \
            and not ctx.server.structured_outputs_in_reasoning:
        end_ids = tokenizer.encode(reasoning.fmt.end, add_special_tokens=False)
        params.structured_outputs = dataclasses.replace(so, after_token_ids=tuple(end_ids))
    markers = set(fmt.markers if fmt is not None else ())
    if reasoning is not None:
        markers |= {reasoning.fmt.start, reasoning.fmt.end}
    special = {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values() if t.special}
    if markers & special:
        params.skip_special_tokens = False


def _call_grammar(body: ChatCompletionRequest, fmt: Optional[ToolFormat]) -> Optional[StructuredOutputsParams]:
    """``required`` or a named function: the output is one call, its arguments matching the schema."""
    choice = body.effective_tool_choice
    if fmt is None or choice == "auto":
        return None
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    try:
        return StructuredOutputsParams(grammar=fmt.call_grammar(body.tool_dicts(), name))
    except Exception as e:  # noqa: BLE001 - xgrammar refuses a parameters schema it cannot convert
        raise bad_request(f"tools: a function's parameters cannot be enforced: {xgrammar_reason(e)}", "tools") from e


def render_chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> TokenizedPrompt:
    """The prompt a chat request runs: its messages (and tools) through the chat template."""
    return _render(ctx, body, _tool_format(ctx, body))


def _render(ctx: ServingContext, body: ChatCompletionRequest, fmt: Optional[ToolFormat]) -> TokenizedPrompt:
    template = getattr(ctx.engine.tokenizer, "chat_template", None)
    if template is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    conversation = body.conversation()
    template_kwargs = _template_kwargs(body, template)
    tools = body.tool_dicts() if fmt is not None else None
    if not template_renders_tools(template) and (tools or any(m["role"] == "tool" or m.get("tool_calls")
                                                             for m in conversation)):
        conversation = tools_as_text(fmt or choose_format(ctx.server.tool_call_parser, template), tools or [],
                                     conversation)
        tools = None
    try:  # image parts out, each its template placeholder (400s name the part)
        policy = MediaPolicy.from_server(ctx.server, reads_images=getattr(ctx.engine, "reads_images", False))
        conversation, images = split_image_parts(conversation, policy)
    except MediaError as e:
        raise bad_request(str(e), e.param) from e
    _check_text(conversation)
    encoder = ctx.prompt_encoder()
    try:
        rendered = encoder.render_chat(conversation, add_generation_prompt=body.opens_assistant_turn, tools=tools,
                                       continue_final_message=body.continue_final_message,
                                       template_kwargs=template_kwargs)
    except Exception as e:  # noqa: BLE001 - templates raise their own errors for bad conversations
        # the first line: not the rendered chat some templates' errors carry
        raise bad_request(f"the chat template refused these messages: {first_line(e)}", "messages") from e
    try:
        prompt = TokenizedPrompt(encoder.plain(rendered), encoder.encode_chat(rendered))
        if images:  # placeholders expanded and pixels made by the model's processor, off the engine
            processed = ctx.engine.process({"prompt_token_ids": prompt.token_ids, "multi_modal_data": {"image": images}},
                                           SamplingParams(max_tokens=1), add_special_tokens=False)
            prompt = TokenizedPrompt(prompt.text, processed.token_ids, processed.mm_features)
        return prompt
    except ValueError as e:
        raise bad_request(f"messages: {e}", "messages") from e


def _template_kwargs(body: ChatCompletionRequest, template) -> Optional[dict]:
    """``chat_template_kwargs`` with ``reasoning_effort`` added for a template that reads it (a
    value in chat_template_kwargs wins); a template that does not: a 400."""
    effort = getattr(body, "reasoning_effort", None)
    if effort is None:
        return body.chat_template_kwargs
    text = template if isinstance(template, str) else str(template)
    if "reasoning_effort" not in text:
        raise bad_request("reasoning_effort: this model's chat template has no reasoning_effort setting; "
                          "remove the field (or use chat_template_kwargs for the template's own switches)",
                          "reasoning_effort")
    return {"reasoning_effort": effort, **(body.chat_template_kwargs or {})}


def _check_text(conversation: list[dict]) -> None:
    """Refuse text that is no Unicode (a lone surrogate, "\\ud800" in JSON), naming where it is."""
    for i, message in enumerate(conversation):
        for key, value in message.items():
            if not isinstance(value, str):
                continue
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(f"messages[{i}].{key} is not valid Unicode text: {e.reason} at character "
                                  f"{e.start}; send text without lone surrogates", f"messages[{i}].{key}") from e


async def collect(stream: TimedStream) -> RequestOutput:
    final = None
    try:
        async for out in stream:
            final = out
    finally:
        stream.close()
    return final


def _response(ctx: ServingContext, body: ChatCompletionRequest, request_id: str, final: RequestOutput,
              fmt: Optional[ToolFormat], reasoning: Optional[ReasoningSplit]) -> ChatCompletionResponse:
    tokenizer = ctx.engine.tokenizer
    tools = body.tool_dicts() if fmt is not None else None
    choices = []
    for c in final.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = _chat_logprobs(tokenizer, c.token_ids, c.logprobs, body.top_logprobs or 0)
        parsed = parse_output(c.text, reasoning, fmt, tools)
        calls = parsed.tool_calls
        message = ChatResponseMessage(role="assistant", reasoning_content=parsed.reasoning, content=parsed.content,
                                      tool_calls=[call.to_openai() for call in calls] if calls else None)
        choices.append(ChatChoice(
            index=c.index, message=message, logprobs=logprobs,
            finish_reason="tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason,
            token_ids=list(c.token_ids) if body.return_token_ids else None,
        ))
    return ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=_usage(final),
        prompt_logprobs=prompt_logprobs_out(tokenizer, final) if body.prompt_logprobs is not None else None)


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, request_id: str, stream: TimedStream,
                  fmt: Optional[ToolFormat], reasoning: Optional[ReasoningSplit]) -> AsyncIterator[str]:
    tokenizer = ctx.engine.tokenizer

    def chunk(choices: list[ChatStreamChoice], usage: Optional[UsageInfo] = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=ctx.model_name, choices=choices, usage=usage))

    tools = body.tool_dicts() if fmt is not None else None
    parsers = [OutputStream(reasoning, fmt, tools) for _ in range(body.n)]
    sent_tokens = [0] * body.n
    finished: set[int] = set()
    final = None
    try:
        yield chunk([ChatStreamChoice(index=i, delta=ChatResponseMessage(role="assistant", content=""))
                     for i in range(body.n)])
        async for out in stream:
            final = out
            for c in out.outputs:
                if c.index in finished:
                    continue  # a finished sample of n keeps appearing in later outputs
                new_ids = c.token_ids[sent_tokens[c.index]:]
                parser = parsers[c.index]
                delta = parser.finish(c.text) if c.finished else parser.delta(c.text)
                calls = delta.tool_calls
                if not (delta.content or delta.reasoning or c.finished
                        or ((body.logprobs or body.return_token_ids) and new_ids)):
                    continue
                logprobs = None
                if body.logprobs:
                    start = sent_tokens[c.index]
                    entries = c.logprobs[start:start + len(new_ids)] if c.logprobs is not None else None
                    logprobs = _chat_logprobs(tokenizer, new_ids, entries, body.top_logprobs or 0)
                sent_tokens[c.index] = len(c.token_ids)
                if c.finished:
                    finished.add(c.index)
                finish_reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
                yield chunk([ChatStreamChoice(
                    index=c.index, delta=ChatResponseMessage(
                        reasoning_content=delta.reasoning or None,
                        content=None if delta.reasoning and not delta.content else delta.content,
                        tool_calls=calls or None),
                    logprobs=logprobs, finish_reason=finish_reason,
                    token_ids=list(new_ids) if body.return_token_ids else None,
                )], _usage(out) if body.continuous_usage else None)
        if body.include_usage_in_stream and final is not None:
            yield chunk([], _usage(final))
    except Exception as e:  # noqa: BLE001 - the 200 is already sent; report in-band
        yield sse(api_error(e, request_id).body())
    finally:
        stream.close()
    yield SSE_DONE


def _chat_logprobs(tokenizer, token_ids: list[int], entries: Optional[list[dict]], num_top: int) -> ChatLogprobs:
    content = []
    for k, token_id in enumerate(token_ids):
        entry = entries[k] if entries is not None and k < len(entries) else {}
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num_top]
        content.append(ChatTokenLogprob(
            **_top(tokenizer, token_id, entry.get(token_id, float("-inf"))).model_dump(),
            top_logprobs=[_top(tokenizer, t, lp) for t, lp in ranked],
        ))
    return ChatLogprobs(content=content)


def _top(tokenizer, token_id: int, logprob: float) -> TopLogprob:
    token = tokenizer.decode([token_id])
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def _usage(final: RequestOutput) -> UsageInfo:
    prompt = len(final.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in final.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
