"""What the completions and chat handlers share: model and readiness checks, starting engine
requests (engine refusals become HTTP errors before any byte is sent), timing them for metrics,
merging several requests' streams, SSE framing, and aborting work whose client went away.

Rule: every engine request a handler starts is closed in a ``finally`` (closing an unfinished
stream aborts it), so neither an error nor a disconnect leaves blocks held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Optional, Union

from fastapi import Request
from pydantic import BaseModel

from kiln.entrypoints.openai.errors import APIError, bad_request, engine_unavailable
from kiln.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from kiln.outputs import RequestOutput
from kiln.runtime.async_engine import AsyncEngine, EngineDeadError, RequestStream
from kiln.sampling_params import SamplingParams

Prompt = Union[str, list[int]]


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


class TimedStream:
    """One engine request's outputs, recorded in the server metrics as they pass."""

    def __init__(self, stream: RequestStream, timer: RequestTimer):
        self._stream = stream
        self._timer = timer

    def __aiter__(self) -> "TimedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self._stream.__anext__()
        self._timer.token(max((len(c.token_ids) for c in out.outputs), default=0))
        if out.finished:
            self._timer.finish(
                len(out.prompt_token_ids),
                [len(c.token_ids) for c in out.outputs],
                [c.finish_reason for c in out.outputs],
            )
        return out

    def close(self, count_abort: bool = True) -> None:
        if count_abort and not self._stream.finished:
            self._timer.abort()
        self._stream.close()


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    metrics: ServerMetrics

    def check(self, model: Optional[str]) -> None:
        """Refuse a request for another model (404) or while the engine cannot take it (503)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           "model", "model_not_found")
        if not self.engine.is_healthy():
            raise engine_unavailable(f"the engine is not running: {self.engine.error!r}"
                                     if self.engine.error else "the engine has shut down")
        if not self.engine.is_ready():
            raise engine_unavailable("the engine is still loading the model; retry shortly")

    async def start(
        self, request_id: str, prompts: list[Prompt], params: SamplingParams, priority: int = 0,
        add_special_tokens: bool = True,
    ) -> list[TimedStream]:
        """One engine request per prompt (ids ``<request_id>-<i>``); all or none are started.

        All are submitted before any acceptance is awaited, so n prompts cost one engine turn."""
        timers = [self.metrics.timer() for _ in prompts]
        results = await asyncio.gather(
            *(self.engine.add_request(f"{request_id}-{i}", p, params, priority, add_special_tokens)
              for i, p in enumerate(prompts)),
            return_exceptions=True,
        )
        streams = [TimedStream(r, t) for r, t in zip(results, timers) if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return streams
        for s in streams:
            s.close(count_abort=False)
        error = errors[0]
        if isinstance(error, ValueError):
            raise bad_request(str(error), _param_of(str(error))) from error
        if isinstance(error, EngineDeadError):
            raise engine_unavailable(str(error)) from error
        raise error


def close_all(streams: list[TimedStream]) -> None:
    for s in streams:
        s.close()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params_or_400(make) -> SamplingParams:
    try:
        return make()
    except ValueError as e:
        raise bad_request(str(e), _param_of(str(e))) from e


def _param_of(message: str) -> Optional[str]:
    # SamplingParams and the engine start their messages with the field they refuse.
    first = message.split(" ", 1)[0]
    known = {"n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "logprobs", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "stop"}
    if first in known:
        return first
    if "max_tokens" in message:
        return "max_tokens"
    return "prompt" if "prompt" in message else None


async def merge_streams(streams: list[TimedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(stream index, output)`` from several streams as outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    inbox: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: TimedStream) -> None:
        try:
            async for out in stream:
                inbox.put_nowait((i, out))
            inbox.put_nowait((i, end))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            inbox.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await inbox.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnected(request: Request, work: Awaitable):
    """Run ``work``; if the client disconnects first, cancel it (its finally-blocks abort) and
    raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(payload: Union[BaseModel, dict]) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error(e: BaseException) -> APIError:
    """The error a stream that already answered 200 reports in-band."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return engine_unavailable(str(e))
    return APIError(500, "internal server error", None, "internal_error")

