"""What every engine client hands the server: request streams, queue limits and the errors.

Both clients (``EngineCoreClient``, the engine core in its own process; ``AsyncEngine``, an engine
on a thread of this process) deliver a request's items to a ``Sink`` (an asyncio queue on the
caller's event loop) from a thread of their own, one wake-up per event loop per batch (``post``);
``RequestStream`` reads them.

Rules:
- A stream yields cumulative ``RequestOutput``s (everything so far), however the engine sends
  them. From a delta engine (``deltas=True``: ``RequestDelta``s) every delta waiting is merged in order, so a consumer
  that fell behind loses nothing and each step costs only what is new; from a cumulative one only
  the newest output waiting is kept.
- The output a delta stream yields is updated in place by the next ``__anext__``: read it before
  awaiting the next.
- ``Admission`` counts what is admitted against ``QueueLimits``; every admitted request gives its
  share back exactly once when it leaves (finished, failed, refused, aborted).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from kiln.config import ServerConfig
from kiln.outputs import CompletionOutput, RequestDelta, RequestOutput, SampleDelta
from kiln.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine has stopped (crashed or shut down); no request can run."""


class QueueFullError(RuntimeError):
    """The engine holds as much as ``QueueLimits`` allows; retry later (HTTP 429)."""


class RequestFailedError(RuntimeError):
    """kiln failed this one request (a bug, logged with its traceback); the engine goes on."""

    def __init__(self, request_id: str, detail: str):
        super().__init__(f"request {request_id} failed inside the engine ({detail})")
        self.request_id = request_id


@dataclass(frozen=True)
class QueueLimits:
    """Backpressure: the most sequences (n per request), and prompt tokens (each of n counts),
    admitted and not yet finished, running or waiting. None: no limit."""

    max_queued_seqs: Optional[int] = None
    max_queued_tokens: Optional[int] = None

    @classmethod
    def from_server(cls, server: ServerConfig) -> "QueueLimits":
        """One frontend's share of the server's limits (``server.api_server_count`` split them)."""
        count = server.api_server_count
        return cls(-(-server.max_queued_seqs // count), -(-server.max_queued_tokens // count))


ACCEPTED = object()  # first item of a stream whose request the engine took


class Sink:
    """Where a client's thread delivers one request's items: an asyncio queue on its event loop.
    It also carries the request's share of the queue limits while it holds one, and its prompt
    (a delta engine leaves the prompt fields of its outputs empty)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_seqs: int = 0, num_tokens: int = 0,
                 prompt: Optional[str] = None, prompt_token_ids: Optional[list[int]] = None):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_seqs = num_seqs
        self.num_tokens = num_tokens
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids if prompt_token_ids is not None else []


class Admission:
    """What is admitted and not yet finished, against ``QueueLimits``; thread-safe."""

    def __init__(self, limits: QueueLimits):
        self.limits = limits
        self.lock = threading.Lock()
        self.num_queued_seqs = 0
        self.num_queued_tokens = 0

    def reserve(self, sink: Sink) -> None:
        """Count a request against the limits (call under ``lock``); raise if it does not fit."""
        for what, num, queued, limit, name in (
            ("sequences", sink.num_seqs, self.num_queued_seqs, self.limits.max_queued_seqs,
             "server.max_queued_seqs"),
            ("prompt tokens", sink.num_tokens, self.num_queued_tokens, self.limits.max_queued_tokens,
             "server.max_queued_tokens"),
        ):
            if limit is not None and num > limit:
                raise ValueError(f"this request needs {num} {what}, more than the server ever queues "
                                 f"({name}={limit}); send fewer prompts, a smaller n or shorter prompts")
            if limit is not None and queued + num > limit:
                raise QueueFullError(f"server busy: {queued} {what} queued ({name}={limit}); retry later")
        self.num_queued_seqs += sink.num_seqs
        self.num_queued_tokens += sink.num_tokens

    def release(self, sink: Sink) -> None:
        """Give a request's share back (any thread; a second call gives nothing)."""
        with self.lock:
            self.num_queued_seqs -= sink.num_seqs
            self.num_queued_tokens -= sink.num_tokens
            sink.num_seqs = sink.num_tokens = 0

    def clear(self) -> None:
        """Everything left (call under ``lock``)."""
        self.num_queued_seqs = self.num_queued_tokens = 0

    def counts(self) -> dict:
        with self.lock:
            return {"num_queued_seqs": self.num_queued_seqs, "num_queued_tokens": self.num_queued_tokens}


class ClientState:
    """What both engine clients keep and report: whether the engine is ready or has stopped (and
    the error that stopped it), and the sinks of the requests it holds, counted in ``Admission``.
    ``_lock`` (the admission lock) orders "a request was submitted" against "the engine stopped"."""

    def __init__(self, limits: QueueLimits):
        self.limits = limits
        self._admission = Admission(limits)
        self._lock = self._admission.lock
        self._sinks: dict[str, Sink] = {}
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._stopping = False

    def is_ready(self) -> bool:
        """The engine is built and takes requests."""
        return self._ready.is_set() and self.is_healthy()

    def is_healthy(self) -> bool:
        """False once the engine has crashed or been shut down."""
        return self._error is None and not self._done.is_set()

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Block until the engine is built; re-raise what building it raised (a bad setting's
        ValueError says what to change), or EngineDeadError once it has stopped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self._ready.is_set() or self._done.is_set()):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine is not ready after {timeout} s")
            self._done.wait(0.05)
        if self.is_ready():
            return
        if self._error is not None and not self._ready.is_set():
            raise self._error
        raise self._dead_error()

    async def _accepted(self, request_id: str, sink: Sink, deltas: bool) -> "RequestStream":
        """The stream of a submitted request, once the engine has taken it (its refusal raised)."""
        try:
            first = await sink.queue.get()
        except BaseException:
            self.abort(request_id)  # cancelled while waiting: the engine may still take it
            raise
        if isinstance(first, BaseException):
            raise first
        return RequestStream(self.abort, request_id, sink, deltas)

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _dead_error(self) -> EngineDeadError:
        if self._error is not None:
            return EngineDeadError(f"the engine has stopped after an error: {self._error!r}")
        return EngineDeadError("the engine has shut down")

    def _close(self, error: EngineDeadError, also: Callable[[], list[Sink]] = list) -> None:
        """Stop taking requests and fail every pending one with ``error`` (and the sinks ``also``
        returns, called under the lock: requests submitted but not yet seen by the engine)."""
        with self._lock:
            self._done.set()
            batch: dict[Sink, list] = {sink: [error] for sink in [*self._sinks.values(), *also()]}
            self._sinks.clear()
            self._admission.clear()
        post(batch)


class RequestStream:
    """The outputs of one request; iterate it. ``close()`` aborts the request if it is unfinished."""

    def __init__(self, abort: Callable[[str], None], request_id: str, sink: Sink, deltas: bool = False):
        self.request_id = request_id
        self._abort = abort
        self._sink = sink
        self._deltas = deltas
        self._output: Optional[RequestOutput] = None  # a delta stream's merged output
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        while isinstance(item, (RequestOutput, RequestDelta)):
            if self._deltas:
                self._merge(item)
            if item.finished or self._sink.queue.empty():
                break
            item = self._sink.queue.get_nowait()  # cumulative: only the newest one matters
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return self._output if self._deltas else item

    def _merge(self, delta: RequestDelta) -> None:
        out = self._output
        if out is None:
            self._output = RequestOutput(
                delta.request_id, self._sink.prompt, self._sink.prompt_token_ids,
                [_copy(c) for c in delta.outputs], delta.finished, delta.num_cached_tokens,
                error=delta.error, prompt_logprobs=delta.prompt_logprobs, embedding=delta.embedding)
            return
        for new, c in zip(delta.outputs, out.outputs):
            c.text += new.text
            c.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs.extend(new.logprobs)
            c.cumulative_logprob = new.cumulative_logprob
            c.finish_reason, c.stop_reason = new.finish_reason, new.stop_reason
        out.finished = delta.finished
        out.num_cached_tokens = delta.num_cached_tokens
        out.error = delta.error
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            out.embedding = delta.embedding

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


def _copy(c: SampleDelta) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                            list(c.logprobs) if c.logprobs is not None else None, c.cumulative_logprob)


def post(batch: dict[Sink, list]) -> list[Sink]:
    """Put items on their sinks' queues, one wake-up per event loop; return sinks whose loop closed."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, list]]] = {}
    for sink, items in batch.items():
        by_loop.setdefault(sink.loop, []).append((sink, items))
    lost = []
    for loop, entries in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, entries)
        except RuntimeError:
            lost.extend(sink for sink, _ in entries)
    return lost


def _put_all(entries: list[tuple[Sink, list]]) -> None:
    for sink, items in entries:
        for item in items:
            sink.queue.put_nowait(item)


class EngineClient(Protocol):
    """What the server needs of an engine client (``EngineCoreClient``, ``AsyncEngine``)."""

    model_name: Optional[str]
    limits: QueueLimits
    tokenizer: Any  # None until the engine is ready
    max_model_len: Optional[int]
    eos_token_ids: tuple[int, ...]  # the model's stop ids, () until the engine is ready

    def is_ready(self) -> bool: ...
    def is_healthy(self) -> bool: ...
    @property
    def error(self) -> Optional[BaseException]: ...
    @property
    def grammars(self) -> Any: ...  # a GrammarCompiler (thread-safe), or None before ready
    def wait_ready(self, timeout: Optional[float] = None) -> None: ...
    def stats(self) -> dict: ...
    def process(self, prompt: Any, params: SamplingParams, add_special_tokens: bool = True) -> Any: ...
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams, priority: int = 0,
                          add_special_tokens: bool = True, pooling: Optional[str] = None) -> RequestStream: ...
    def abort(self, request_id: str) -> None: ...
    def shutdown(self, timeout: Optional[float] = 30.0) -> None: ...
