"""POST /v1/chat/completions: the tokenizer's chat template turns the messages into one prompt.

The prompt is rendered (``add_generation_prompt=True``) and tokenized by the ``PromptEncoder``:
control tokens the template writes are control tokens, those typed in a message are text, so no
message can forge a turn. A stream opens with one chunk per choice that carries
``role: "assistant"``; content deltas follow, the last carrying the finish reason.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kiln.entrypoints.openai.errors import bad_request
from kiln.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, TopLogprob, UsageInfo,
)
from kiln.entrypoints.openai.serving import (
    SSE_DONE, ClientGone, ServingContext, TimedStream, api_error, new_id, sampling_params_or_400, sse,
    until_disconnected,
)
from kiln.outputs import RequestOutput
from kiln.runtime.input_processor import TokenizedPrompt


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check(body.model)
    prompt = _render(ctx, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params_or_400(lambda: body.sampling_params(max_tokens, num_logprobs))
    request_id = new_id("chatcmpl")
    streams = await ctx.start(request_id, [prompt], params, body.priority, add_special_tokens=False,
                              prompt_param="messages")
    if body.stream:
        return StreamingResponse(_stream(ctx, body, request_id, streams[0]), media_type="text/event-stream")
    try:
        final = await until_disconnected(raw, _collect(streams[0]))
        return _response(ctx, body, request_id, final)
    except ClientGone:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 - a kiln bug or a stopped engine: an answer in OpenAI's schema
        raise api_error(e, request_id) from e


def _render(ctx: ServingContext, body: ChatCompletionRequest) -> TokenizedPrompt:
    if getattr(ctx.engine.tokenizer, "chat_template", None) is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    conversation = body.conversation()
    _check_text(conversation)
    encoder = ctx.prompt_encoder()
    try:
        rendered = encoder.render_chat(conversation)
    except Exception as e:  # noqa: BLE001 - templates raise their own errors for bad conversations
        raise bad_request(f"the chat template refused these messages: {e}", "messages") from e
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
              final: RequestOutput) -> ChatCompletionResponse:
    tokenizer = ctx.engine.tokenizer
    choices = []
    for c in final.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = _chat_logprobs(tokenizer, c.token_ids, c.logprobs, body.top_logprobs or 0)
        choices.append(ChatChoice(
            index=c.index, message=ChatResponseMessage(role="assistant", content=c.text),
            logprobs=logprobs, finish_reason=c.finish_reason,
            token_ids=list(c.token_ids) if body.return_token_ids else None,
        ))
    return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=_usage(final))


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, request_id: str,
                  stream: TimedStream) -> AsyncIterator[str]:
    tokenizer = ctx.engine.tokenizer

    def chunk(choices: list[ChatStreamChoice], usage: Optional[UsageInfo] = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=ctx.model_name, choices=choices, usage=usage))

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
                text = c.text[sent_chars[c.index]:]
                new_ids = c.token_ids[sent_tokens[c.index]:]
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
                yield chunk([ChatStreamChoice(
                    index=c.index, delta=ChatResponseMessage(content=text), logprobs=logprobs,
                    finish_reason=c.finish_reason, token_ids=list(new_ids) if body.return_token_ids else None,
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
