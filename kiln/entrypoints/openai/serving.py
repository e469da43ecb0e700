"""What the completions and chat handlers share: model and readiness checks, starting engine
requests (engine refusals become HTTP errors before any byte is sent), timing them for metrics,
merging several requests' streams, SSE framing, and aborting work whose client went away.

Rules:
- Every engine request a handler starts is closed in a ``finally`` (closing an unfinished stream
  aborts it), so neither an error nor a disconnect leaves blocks held.
- A request is sized before the engine sees it: prompts and prompts x n against the server's
  per-request limits (400), its prompts tokenized and checked here (400), then admitted against
  the engine's queue limits (429, or 400 when it could never fit); all of it or none starts.
- Every failure becomes an error in OpenAI's schema (``api_error``): a kiln bug is a 500 that
  names the request id, which the server log names too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from kiln.config import ServerConfig
from kiln.lora_request import LoRARequest
from kiln.entrypoints.openai.errors import APIError, bad_request, engine_unavailable
from kiln.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from kiln.entrypoints.prompt_encoder import PromptEncoder
from kiln.outputs import RequestOutput
from kiln.engine.streams import EngineClient, EngineDeadError, QueueFullError, RequestFailedError, RequestStream
from kiln.runtime.input_processor import TokenizedPrompt
from kiln.runtime.structured_output import GrammarError
from kiln.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

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
    engine: EngineClient
    model_name: str
    metrics: ServerMetrics
    server: ServerConfig = field(default_factory=ServerConfig)  # its per-request limits
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # adapter name -> adapter ("model": name)
    _prompt_encoder: Optional[PromptEncoder] = field(default=None, init=False, repr=False)

    def prompt_encoder(self) -> Optional[PromptEncoder]:
        """Encodes user text with control tokens as text; built on first use (the engine loads its
        tokenizer after the app is built). None for an engine without a tokenizer (a test stand-in)."""
        if self._prompt_encoder is None and self.engine.tokenizer is not None:
            self._prompt_encoder = PromptEncoder(self.engine.tokenizer)
        return self._prompt_encoder

    def check(self, model: Optional[str]) -> None:
        """Refuse a request for another model (404) or while the engine cannot take it (503)."""
        if model is not None and model != self.model_name and model not in self.loras:
            adapters = "".join(f", `{name}`" for name in self.loras)
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`"
                           f"{adapters}", "model", "model_not_found")
        if not self.engine.is_healthy():
            raise engine_unavailable(f"the engine is not running: {self.engine.error!r}"
                                     if self.engine.error else "the engine has shut down")
        if not self.engine.is_ready():
            raise engine_unavailable("the engine is still loading the model; retry shortly")

    def lora_for(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names, None for the base model."""
        return self.loras.get(model) if model is not None else None

    async def start(
        self, request_id: str, prompts: list[Prompt], params: SamplingParams, priority: int = 0,
        add_special_tokens: bool = True, *, prompt_param: str = "prompt", pooling: Optional[str] = None,
        lora: Optional[LoRARequest] = None,
    ) -> list[TimedStream]:
        """One engine request per prompt (ids ``<request_id>-<i>``); all or none are started.

        All are submitted before any acceptance is awaited, so n prompts cost one engine turn.
        ``prompt_param``: the field a bad prompt is blamed on."""
        self._check_size(len(prompts), params.n)
        await self._compile_grammar(params)
        try:
            processed = [self.engine.process(p, params, add_special_tokens) for p in prompts]
        except ValueError as e:
            raise bad_request(str(e), _param_of(str(e), prompt_param)) from e
        except Exception as e:  # noqa: BLE001 - a kiln bug: a 500 that names the request
            raise api_error(e, request_id) from e
        self._check_fits(processed, params.n)
        timers = [self.metrics.timer() for _ in prompts]
        results = await asyncio.gather(
            *(self.engine.add_request(f"{request_id}-{i}", p, params, priority, add_special_tokens,
                                      **({"pooling": pooling} if pooling else {}),
                                      **({"lora_request": lora} if lora else {}))
              for i, p in enumerate(processed)),
            return_exceptions=True,
        )
        streams = [TimedStream(r, t) for r, t in zip(results, timers) if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return streams
        for s in streams:
            s.close(count_abort=False)
        error = next((e for e in errors if isinstance(e, (ValueError, QueueFullError))), errors[0])
        if isinstance(error, ValueError):
            raise bad_request(str(error), _param_of(str(error), prompt_param)) from error
        raise api_error(error, request_id) from error

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile a structured-output constraint in the grammar thread pool, off the event loop and
        the engine thread (which then finds it cached); one xgrammar cannot compile is a 400."""
        grammars = getattr(self.engine, "grammars", None)
        if params.structured_outputs is None or grammars is None:
            return
        try:
            await asyncio.wrap_future(grammars.submit(params.structured_outputs))
        except GrammarError as e:
            raise bad_request(str(e), "structured_outputs") from e

    def _check_size(self, num_prompts: int, n: int) -> None:
        """The server's per-request limits (400)."""
        limit = self.server.max_prompts_per_request
        if num_prompts > limit:
            raise APIError(400, f"the request has {num_prompts} prompts, more than this server takes in one "
                                f"request (server.max_prompts_per_request={limit}); split them over several "
                                "requests", "prompt", "limit_exceeded")
        limit = self.server.max_seqs_per_request
        if num_prompts * n > limit:
            raise APIError(400, f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences, more than this "
                                f"server runs for one request (server.max_seqs_per_request={limit}); lower n or "
                                "send fewer prompts", "n", "limit_exceeded")

    def _check_fits(self, processed: list, n: int) -> None:
        """A request larger than the engine's whole queue could never start: 400, not 429."""
        limits = self.engine.limits
        num_seqs = len(processed) * n
        num_tokens = n * sum(len(p.token_ids) if isinstance(p, TokenizedPrompt) else len(p) for p in processed)
        for what, num, limit, name in (("sequences", num_seqs, limits.max_queued_seqs, "server.max_queued_seqs"),
                                       ("prompt tokens", num_tokens, limits.max_queued_tokens,
                                        "server.max_queued_tokens")):
            if limit is not None and num > limit:
                raise APIError(400, f"the request needs {num} {what} (prompts x n), more than the server ever "
                                    f"queues ({name}={limit}); send fewer or shorter prompts or a smaller n",
                               "prompt", "limit_exceeded")


def close_all(streams: list[TimedStream]) -> None:
    for s in streams:
        s.close()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def prompt_logprobs_out(tokenizer, out: RequestOutput) -> Optional[list]:
    """vLLM's shape of ``RequestOutput.prompt_logprobs``: None, or per prompt token None (the
    first) or {token id: {"logprob", "decoded_token"}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else {str(t): {"logprob": lp, "decoded_token": tokenizer.decode([t])}
                                        for t, lp in entry.items()} for entry in out.prompt_logprobs]


def sampling_params_or_400(make) -> SamplingParams:
    try:
        return make()
    except ValueError as e:
        raise bad_request(str(e), _param_of(str(e))) from e


def _param_of(message: str, prompt_param: str = "prompt") -> Optional[str]:
    # SamplingParams and the engine start their messages with the field they refuse.
    first = message.split(" ", 1)[0].rstrip(":")
    known = {"structured_outputs", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "logprobs", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "stop", "seed", "min_tokens", "logit_bias",
             "prompt_logprobs", "best_of", "use_beam_search", "length_penalty", "early_stopping"}
    if first in known:
        return first
    if "max_tokens" in message:
        return "max_tokens"
    return prompt_param if "prompt" in message else None


async def collect_finals(streams: list[TimedStream]) -> list[Optional[RequestOutput]]:
    """The finished output of each stream (in order), closing them all however it ends."""
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
    try:
        async for i, out in merge_streams(streams):
            if out.finished:
                finals[i] = out
    finally:
        close_all(streams)
    return finals


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


async def respond_when_done(request: Request, request_id: str, work: Awaitable, respond: Callable):
    """``respond(result of work)``, or a 499 once the client has gone (``work`` cancelled); what
    fails on the way is an answer in OpenAI's schema (``api_error``)."""
    try:
        return respond(await until_disconnected(request, work))
    except ClientGone:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 - a kiln bug or a stopped engine: an answer in OpenAI's schema
        raise api_error(e, request_id) from e


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


def api_error(e: BaseException, request_id: str) -> APIError:
    """The HTTP error for what running a request raised (also in-band, once a stream answered 200).

    Bad input is refused before a request starts, so anything unexpected here is a kiln bug: a
    500 naming the request, whose traceback the log holds (the engine logged its own failures)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return engine_unavailable(str(e))
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), None, "server_busy")
    if not isinstance(e, RequestFailedError):
        logger.error("request %s failed", request_id, exc_info=e)
    return APIError(500, f"kiln failed request {request_id} (an internal error, logged on the server); "
                         "other requests are not affected, so retrying may work", None, "internal_error")
