"""POST /v1/completions: one engine request per prompt, choices numbered ``prompt * n + sample``.

Logprobs use OpenAI's legacy format (tokens, token_logprobs, top_logprobs, text_offset). With
``echo`` the prompt's tokens lead the list, scored by the engine (the first token's logprob is null:
nothing predicts it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kiln.entrypoints.beam_search import ranks_outputs
from kiln.entrypoints.openai.errors import bad_request
from kiln.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, UsageInfo,
)
from kiln.entrypoints.openai.serving import (
    SSE_DONE, ClientGone, ServingContext, TimedStream, api_error, close_all, collect_finals, merge_streams, new_id,
    prompt_logprobs_out, sampling_params_or_400, sse, until_disconnected,
)
from kiln.entrypoints.openai.serving_beam_search import refuse_stream, run_ranked
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.runtime.input_processor import TokenizedPrompt


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw: Request) -> Response:
    ctx.check(body.model)
    prompts = [_as_text(ctx, p) if isinstance(p, str) and not body.parse_special_tokens else p
               for p in body.prompts()]
    if not prompts:
        raise bad_request("prompt is empty; give a string, a list of strings or token ids", "prompt")
    params = sampling_params_or_400(lambda: body.sampling_params(body.max_tokens, body.logprobs))
    request_id = new_id("cmpl")
    if ranks_outputs(params):  # beam search or best_of > n: answered once every candidate is done
        refuse_stream(params, body.stream)
        ranked = run_ranked(ctx, request_id, prompts, params, body.priority, lora=ctx.lora_for(body.model))
        try:
            return _response(ctx, body, request_id, await until_disconnected(raw, ranked))
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - a kiln bug or a stopped engine: an answer in OpenAI's schema
            raise api_error(e, request_id) from e
    streams = await ctx.start(request_id, prompts, params, body.priority, lora=ctx.lora_for(body.model))
    if body.stream:
        return StreamingResponse(_stream(ctx, body, request_id, streams), media_type="text/event-stream")
    try:
        finals = await until_disconnected(raw, collect_finals(streams))
        return _response(ctx, body, request_id, finals)
    except ClientGone:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 - a kiln bug or a stopped engine: an answer in OpenAI's schema
        raise api_error(e, request_id) from e


def _as_text(ctx: ServingContext, prompt: str) -> Union[str, TokenizedPrompt]:
    """A text prompt tokenized as text: control tokens typed in it are characters (opt out with
    ``parse_special_tokens``). An engine without a tokenizer (a test stand-in) gets the string."""
    encoder = ctx.prompt_encoder()
    if encoder is None:
        return prompt
    try:
        return TokenizedPrompt(prompt, encoder.encode_text(prompt))
    except ValueError as e:
        raise bad_request(f"prompt: {e}", "prompt") from e


def _response(ctx: ServingContext, body: CompletionRequest, request_id: str,
              finals: list[RequestOutput]) -> CompletionResponse:
    tokenizer = ctx.engine.tokenizer
    choices = []
    for i, out in enumerate(finals):
        for c in out.outputs:
            prompt_text = _prompt_text(tokenizer, out) if body.echo else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs = _legacy_logprobs(tokenizer, c.token_ids, c.logprobs, body.logprobs, len(prompt_text))
                if body.echo:
                    logprobs = _with_echo(tokenizer, out, logprobs, body.logprobs)
            text = prompt_text + c.text
            choices.append(CompletionChoice(
                index=i * body.n + c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                token_ids=list(c.token_ids) if body.return_token_ids else None,
                prompt_logprobs=prompt_logprobs_out(tokenizer, out) if body.prompt_logprobs is not None else None,
            ))
    return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=_usage(finals))


@dataclass
class _Sent:
    """What one streamed choice has sent so far."""

    chars: int = 0
    tokens: int = 0
    next_offset: Optional[int] = None  # text_offset of the next token; None before the first chunk
    finished: bool = False


async def _stream(ctx: ServingContext, body: CompletionRequest, request_id: str,
                  streams: list[TimedStream]) -> AsyncIterator[str]:
    tokenizer = ctx.engine.tokenizer
    sent: dict[int, _Sent] = {}  # by choice index
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
    latest: list[Optional[RequestOutput]] = [None] * len(streams)  # for continuous usage stats
    try:
        async for i, out in merge_streams(streams):
            latest[i] = out
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                index = i * body.n + c.index
                choice = _delta(tokenizer, body, out, c, index, sent.setdefault(index, _Sent()))
                if choice is not None:
                    yield sse(CompletionResponse(id=request_id, model=ctx.model_name, choices=[choice],
                                                 usage=_usage(latest) if body.continuous_usage else None))
        if body.include_usage_in_stream:
            yield sse(CompletionResponse(id=request_id, model=ctx.model_name, choices=[], usage=_usage(finals)))
    except Exception as e:  # noqa: BLE001 - the 200 is already sent; report in-band
        yield sse(api_error(e, request_id).body())
    finally:
        close_all(streams)
    yield SSE_DONE


def _delta(tokenizer, body: CompletionRequest, out: RequestOutput, c: CompletionOutput, index: int,
           sent: _Sent) -> Optional[CompletionChoice]:
    """The next chunk of one choice (updating ``sent``), or None when it has nothing new to say."""
    if sent.finished:
        return None  # a finished sample of n keeps appearing in its request's later outputs
    first = sent.next_offset is None
    prefix = _prompt_text(tokenizer, out) if first and body.echo else ""
    text = c.text[sent.chars:]
    new_ids = c.token_ids[sent.tokens:]
    logprobs = None
    if body.logprobs is not None:
        entries = c.logprobs[sent.tokens:len(c.token_ids)] if c.logprobs is not None else None
        start = len(prefix) if first else sent.next_offset
        logprobs = _legacy_logprobs(tokenizer, new_ids, entries, body.logprobs, start)
        if prefix:
            logprobs = _with_echo(tokenizer, out, logprobs, body.logprobs)
    if not (text or prefix or c.finished or ((logprobs is not None or body.return_token_ids) and new_ids)):
        return None
    sent.chars, sent.tokens, sent.finished = len(c.text), len(c.token_ids), c.finished
    if logprobs is not None and logprobs.text_offset:
        sent.next_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
    elif first:
        sent.next_offset = len(prefix)
    return CompletionChoice(index=index, text=prefix + text, logprobs=logprobs, finish_reason=c.finish_reason,
                            token_ids=list(new_ids) if body.return_token_ids else None)


def _legacy_logprobs(tokenizer, token_ids: list[int], entries: Optional[list[dict]], num_top: int,
                     offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for k, token_id in enumerate(token_ids):
        token = tokenizer.decode([token_id])
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        entry = entries[k] if entries is not None and k < len(entries) else None
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.get(token_id))
        # The top num_top, plus the sampled token when it is not among them (as vLLM does).
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num_top]
        if token_id in entry and all(t != token_id for t, _ in ranked):
            ranked.append((token_id, entry[token_id]))
        out.top_logprobs.append({tokenizer.decode([t]): lp for t, lp in ranked} if num_top > 0 else None)
    return out


def _with_echo(tokenizer, out: RequestOutput, logprobs: CompletionLogprobs, num_top: int) -> CompletionLogprobs:
    """Prepend the prompt's tokens (offsets from 0; the first token's logprob null) to the generated ones'."""
    head = _legacy_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs, num_top, 0)
    return CompletionLogprobs(
        tokens=head.tokens + logprobs.tokens,
        token_logprobs=head.token_logprobs + logprobs.token_logprobs,
        top_logprobs=head.top_logprobs + logprobs.top_logprobs,
        text_offset=head.text_offset + logprobs.text_offset,
    )


def _prompt_text(tokenizer, out: RequestOutput) -> str:
    return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)


def _usage(finals: list[Optional[RequestOutput]]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals if o is not None)
    completion = sum(len(c.token_ids) for o in finals if o is not None for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
