"""POST /v1/responses: OpenAI's Responses API, stateless, run as the chat request it describes.

The request becomes a chat request (``ResponsesRequest.chat_request``), which the chat handler's
``prepare_chat`` renders and turns into sampling params (chat template, tools, grammars, reasoning
split), so both APIs build the same prompt; its 400s name the Responses field (``input``,
``text.format``, ...). The text the model writes is read by ``output_parser.py`` into output items:
a ``reasoning`` item (with ``server.reasoning_parser``), a ``message`` with one ``output_text``
part, then one ``function_call`` item per call. A response cut by ``max_output_tokens`` is
``incomplete``.

A stream is OpenAI's events (``event:`` and ``data:`` lines, numbered by ``sequence_number``, no
``[DONE]``): ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, ``response.content_part.added``, text deltas
(``response.reasoning_text.delta`` / ``response.output_text.delta``), their ``.done``,
``response.content_part.done`` and ``response.output_item.done``; calls, known only once the text
ends, come as ``response.function_call_arguments.delta`` and ``.done`` each; last
``response.completed`` (or ``response.incomplete``) with the whole response. The same builder
(``ResponseOutput``) makes the items of an unstreamed response, so both carry the same items.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from kiln.entrypoints.openai.errors import APIError, bad_request
from kiln.entrypoints.openai.output_parser import OutputStream, parse_output
from kiln.entrypoints.openai.protocol_responses import (
    IncompleteDetails, OutputFunctionCall, OutputItem, OutputMessage, OutputReasoning, OutputText,
    OutputTokensDetails, ReasoningText, ResponseObject, ResponsesRequest, ResponsesUsage,
)
from kiln.entrypoints.openai.serving import ServingContext, TimedStream, api_error, new_id, respond_when_done
from kiln.entrypoints.openai.serving_chat import PreparedChat, collect, prepare_chat
from kiln.outputs import RequestOutput

# The chat request's fields as the Responses request names them, for the 400s of prepare_chat.
_PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
           "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "reasoning_effort": "reasoning.effort"}


async def create_response(ctx: ServingContext, body: ResponsesRequest, raw: Request) -> Response:
    try:
        chat_body = body.chat_request()
    except ValidationError as e:
        error = e.errors()[0]
        raise bad_request(f"input: {error['msg']}", "input") from e
    except ValueError as e:
        raise bad_request(str(e), "input") from e
    response = ResponseObject.start(new_id("resp"), body.model or ctx.model_name, body)  # a LoRA adapter's name too
    with _responses_params():
        chat = prepare_chat(ctx, chat_body)
        streams = await ctx.start(response.id, [chat.prompt], chat.params, chat_body.priority,
                                  add_special_tokens=False, prompt_param="input", lora=ctx.lora_for(body.model))
    if body.stream:
        return StreamingResponse(_stream(ctx, response, streams[0], chat), media_type="text/event-stream")
    return await respond_when_done(raw, response.id, collect(streams[0]),
                                   lambda final: _unstreamed(ctx, response, final, chat))


@contextlib.contextmanager
def _responses_params():
    """A 400 of the chat request names the Responses field it came from."""
    try:
        yield
    except APIError as e:
        if e.param is not None:
            head = re.match(r"[a-z_]+", e.param)
            if head is not None and head.group(0) in _PARAMS:
                e.param = _PARAMS[head.group(0)]
        raise


class ResponseOutput:
    """One response's output items, built as its parsed text arrives; each call returns the
    stream events it makes (without sequence numbers). One item is open at a time: reasoning or
    a message, each with one text part; a change of kind closes it."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: Optional[OutputItem] = None

    def reasoning(self, text: str) -> list[dict]:
        return self._text(OutputReasoning, ReasoningText, "response.reasoning_text", text)

    def content(self, text: str) -> list[dict]:
        return self._text(OutputMessage, OutputText, "response.output_text", text)

    def calls(self, calls: list[dict]) -> list[dict]:
        """Function calls in the chat API's shape (id, function {name, arguments}), each one item."""
        events = self._close("completed") if calls else []
        for call in calls:
            item = OutputFunctionCall(id=new_id("fc"), call_id=call["id"], name=call["function"]["name"])
            events.append(self._added(item))
            item.arguments = call["function"]["arguments"]
            where = {"item_id": item.id, "output_index": len(self.items) - 1}
            events += [{"type": "response.function_call_arguments.delta", **where, "delta": item.arguments},
                       {"type": "response.function_call_arguments.done", **where, "arguments": item.arguments}]
            item.status = "completed"
            events.append(self._item_done(item))
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the open item (``status``: completed or incomplete); a response with no output
        at all gets an empty message, as a chat answer gets empty content."""
        events = [] if self.items else self._open_text(OutputMessage, OutputText)
        return events + self._close(status)

    @property
    def reasoning_text(self) -> str:
        return "".join(p.text for item in self.items if isinstance(item, OutputReasoning) for p in item.content)

    def _text(self, kind, part_kind, event: str, text: str) -> list[dict]:
        if not text:
            return []
        events = [] if isinstance(self._open, kind) else self._close("completed") + self._open_text(kind, part_kind)
        self._open.content[0].text += text
        return events + [{"type": f"{event}.delta", **self._where(self._open), "delta": text}]

    def _open_text(self, kind, part_kind) -> list[dict]:
        self._open = kind(id=new_id("msg" if kind is OutputMessage else "rs"))
        added = self._added(self._open)
        self._open.content.append(part_kind())
        return [added, {"type": "response.content_part.added", **self._where(self._open),
                        "part": self._open.content[0].model_dump(mode="json")}]

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = self._where(item)
        part = item.content[0]
        kind = "response.output_text" if isinstance(item, OutputMessage) else "response.reasoning_text"
        item.status = status
        return [{"type": f"{kind}.done", **where, "text": part.text},
                {"type": "response.content_part.done", **where, "part": part.model_dump(mode="json")},
                self._item_done(item)]

    def _added(self, item: OutputItem) -> dict:
        self.items.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": item.model_dump(mode="json")}

    def _item_done(self, item: OutputItem) -> dict:
        return {"type": "response.output_item.done", "output_index": self.items.index(item),
                "item": item.model_dump(mode="json")}

    def _where(self, item: OutputItem) -> dict:
        """Where a text event belongs: the item, its place in the output, its (one) part."""
        return {"item_id": item.id, "output_index": self.items.index(item), "content_index": 0}


def _status(final: RequestOutput) -> str:
    return "incomplete" if final.outputs[0].finish_reason == "length" else "completed"


def _unstreamed(ctx: ServingContext, response: ResponseObject, final: RequestOutput,
                chat: PreparedChat) -> ResponseObject:
    parsed = parse_output(final.outputs[0].text, chat.reasoning, chat.fmt, chat.tools)
    out = ResponseOutput()
    out.reasoning(parsed.reasoning or "")
    out.content(parsed.content or "")
    out.calls([call.to_openai() for call in parsed.tool_calls])
    out.finish(_status(final))
    return _done(ctx, response, out, final)


def _done(ctx: ServingContext, response: ResponseObject, out: ResponseOutput, final: RequestOutput) -> ResponseObject:
    """``response`` finished: its items, status and usage."""
    status = _status(final)
    num_input, num_output = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
    thought = out.reasoning_text
    # The thinking's length in tokens, as the tokenizer writes it (its markers not counted).
    num_reasoning = len(ctx.engine.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
    return response.model_copy(update={
        "status": status, "output": out.items,
        "incomplete_details": IncompleteDetails() if status == "incomplete" else None,
        "usage": ResponsesUsage(input_tokens=num_input, output_tokens=num_output, total_tokens=num_input + num_output,
                                output_tokens_details=OutputTokensDetails(reasoning_tokens=min(num_reasoning, num_output))),
    })


async def _stream(ctx: ServingContext, response: ResponseObject, stream: TimedStream,
                  chat: PreparedChat) -> AsyncIterator[str]:
    sequence_number = 0

    def event(payload: dict) -> str:
        nonlocal sequence_number
        payload = {**payload, "sequence_number": sequence_number}
        sequence_number += 1
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    parser = OutputStream(chat.reasoning, chat.fmt, chat.tools)
    out = ResponseOutput()
    try:
        for kind in ("response.created", "response.in_progress"):
            yield event({"type": kind, "response": response.model_dump(mode="json")})
        final = None
        async for final in stream:
            sample = final.outputs[0]
            delta = parser.finish(sample.text) if sample.finished else parser.delta(sample.text)
            events = out.reasoning(delta.reasoning) + out.content(delta.content)
            if sample.finished:
                events += out.calls(delta.tool_calls) + out.finish(_status(final))
            for e in events:
                yield event(e)
        done = _done(ctx, response, out, final)
        yield event({"type": f"response.{done.status}", "response": done.model_dump(mode="json")})
    except Exception as e:  # noqa: BLE001 - the 200 is already sent; report in-band, as OpenAI does
        error = api_error(e, response.id)
        yield event({"type": "error", "code": error.code, "message": error.message, "param": error.param})
    finally:
        stream.close()
