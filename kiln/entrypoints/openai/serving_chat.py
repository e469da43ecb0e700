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
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kiln.entrypoints.openai.errors import bad_request
from kiln.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, NamedToolChoice, TopLogprob, UsageInfo,
)
from kiln.entrypoints.openai.serving import (
    SSE_DONE, ClientGone, ServingContext, TimedStream, api_error, new_id, prompt_logprobs_out,
    sampling_params_or_400, sse, until_disconnected,
)
from kiln.entrypoints.openai.tool_calls import (
    ToolFormat, ToolStreamer, choose_format, template_renders_tools, tools_as_text,
)
from kiln.errors import first_line
from kiln.outputs import RequestOutput
from kiln.sampling_params import StructuredOutputsParams
from kiln.runtime.input_processor import TokenizedPrompt
from kiln.runtime.structured_output import xgrammar_reason


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check(body.model)
    try:
        body.check_tools()
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from e
    fmt = _tool_format(ctx, body)
    prompt = _render(ctx, body, fmt)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    call_grammar = _call_grammar(body, fmt)
    params = sampling_params_or_400(lambda: body.sampling_params(max_tokens, num_logprobs, call_grammar))
    request_id = new_id("chatcmpl")
    streams = await ctx.start(request_id, [prompt], params, body.priority, add_special_tokens=False,
                              prompt_param="messages")
    if body.stream:
        return StreamingResponse(_stream(ctx, body, request_id, streams[0], fmt), media_type="text/event-stream")
    try:
        final = await until_disconnected(raw, _collect(streams[0]))
        return _response(ctx, body, request_id, final, fmt)
    except ClientGone:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 - a kiln bug or a stopped engine: an answer in OpenAI's schema
        raise api_error(e, request_id) from e


def _tool_format(ctx: ServingContext, body: ChatCompletionRequest) -> Optional[ToolFormat]:
    """The format tool calls are written in, or None when this request calls no tools."""
    if body.effective_tool_choice == "none":
        return None
    return choose_format(ctx.server.tool_call_parser, getattr(ctx.engine.tokenizer, "chat_template", None))


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
    tools = body.tool_dicts() if fmt is not None else None
    if not template_renders_tools(template) and (tools or any(m["role"] == "tool" or m.get("tool_calls")
                                                             for m in conversation)):
        conversation = tools_as_text(fmt or choose_format(ctx.server.tool_call_parser, template), tools or [],
                                     conversation)
        tools = None
    _check_text(conversation)
    encoder = ctx.prompt_encoder()
    try:
        rendered = encoder.render_chat(conversation, add_generation_prompt=body.opens_assistant_turn, tools=tools,
                                       continue_final_message=body.continue_final_message,
                                       template_kwargs=body.chat_template_kwargs)
    except Exception as e:  # noqa: BLE001 - templates raise their own errors for bad conversations
        # the first line: not the rendered chat some templates' errors carry
        raise bad_request(f"the chat template refused these messages: {first_line(e)}", "messages") from e
    try:
        return TokenizedPrompt(encoder.plain(rendered), encoder.encode_chat(rendered))
    except ValueError as e:
        raise bad_request(f"messages: {e}", "messages") from e


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


async def _collect(stream: TimedStream) -> RequestOutput:
    final = None
    try:
        async for out in stream:
            final = out
    finally:
        stream.close()
    return final


def _response(ctx: ServingContext, body: ChatCompletionRequest, request_id: str,
              final: RequestOutput, fmt: Optional[ToolFormat]) -> ChatCompletionResponse:
    tokenizer = ctx.engine.tokenizer
    choices = []
    for c in final.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = _chat_logprobs(tokenizer, c.token_ids, c.logprobs, body.top_logprobs or 0)
        content, calls = fmt.parse(c.text) if fmt is not None else (c.text, [])
        message = ChatResponseMessage(role="assistant", content=content,
                                      tool_calls=[call.to_openai() for call in calls] if calls else None)
        choices.append(ChatChoice(
            index=c.index, message=message, logprobs=logprobs,
            finish_reason="tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason,
            token_ids=list(c.token_ids) if body.return_token_ids else None,
        ))
    return ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices, usage=_usage(final),
        prompt_logprobs=prompt_logprobs_out(tokenizer, final) if body.prompt_logprobs is not None else None)


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, request_id: str,
                  stream: TimedStream, fmt: Optional[ToolFormat]) -> AsyncIterator[str]:
    tokenizer = ctx.engine.tokenizer

    def chunk(choices: list[ChatStreamChoice], usage: Optional[UsageInfo] = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=ctx.model_name, choices=choices, usage=usage))

    streamers = [ToolStreamer(fmt) for _ in range(body.n)] if fmt is not None else []
    sent_chars = [0] * body.n
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
                calls = None
                if fmt is None:
                    text = c.text[sent_chars[c.index]:]
                elif c.finished:
                    text, calls = streamers[c.index].finish(c.text)
                else:
                    text = streamers[c.index].content_delta(c.text)
                if not (text or c.finished or ((body.logprobs or body.return_token_ids) and new_ids)):
                    continue
                logprobs = None
                if body.logprobs:
                    start = sent_tokens[c.index]
                    entries = c.logprobs[start:start + len(new_ids)] if c.logprobs is not None else None
                    logprobs = _chat_logprobs(tokenizer, new_ids, entries, body.top_logprobs or 0)
                sent_chars[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                if c.finished:
                    finished.add(c.index)
                finish_reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
                yield chunk([ChatStreamChoice(
                    index=c.index, delta=ChatResponseMessage(content=text, tool_calls=calls or None),
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
