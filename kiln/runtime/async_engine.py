"""AsyncEngine: drives one LLMEngine from a dedicated thread for asyncio callers (the server).

    engine = AsyncEngine.from_config(config)
    engine.wait_ready()
    async for out in engine.generate("req-1", "Hello", SamplingParams(max_tokens=8)):
        print(out.outputs[0].text)     # cumulative, like LLMEngine.step()'s outputs

Threads and rules:
- The engine thread is the only one that touches the LLMEngine (it builds it, steps it, shuts it
  down). Callers talk to it through one thread-safe input queue (add, abort, stop); outputs go
  back to one asyncio queue per request through ``loop.call_soon_threadsafe``, one call per event
  loop per step.
- When no request is unfinished the thread blocks on the input queue: an idle engine costs nothing.
- ``abort`` is synchronous and safe from any thread or a ``finally``; the request's blocks are freed
  on the engine thread's next turn (at once when it is idle). A stream dropped before it finished
  aborts its request. Adds and aborts are applied between ``step()`` calls, while a step may be in
  flight: they queue or free, never allocate (the engine's pipeline rule), and ``step()`` is called
  while ``has_unfinished_requests()``, which counts the step in flight, so the last one is drained.
- If the thread dies with an exception, every pending and later request raises EngineDeadError and
  ``is_healthy()`` turns False: nobody waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Union

from kiln.config import EngineConfig
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crashed or shut down); no request can run."""


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int
    add_special_tokens: bool
    sink: "_Sink"


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


_ACCEPTED = object()  # first item of a stream whose request the engine took


class _Sink:
    """Where the engine thread delivers one request's items: an asyncio queue on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()


class RequestStream:
    """The outputs of one request; iterate it. ``close()`` aborts the request if it is unfinished."""

    def __init__(self, engine: "AsyncEngine", request_id: str, sink: _Sink):
        self.request_id = request_id
        self._engine = engine
        self._sink = sink
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        # Outputs are cumulative, so a consumer that fell behind only needs the newest one.
        while isinstance(item, RequestOutput) and not item.finished and not self._sink.queue.empty():
            item = self._sink.queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, make_engine: Callable[[], object], model_name: Optional[str] = None):
        """``make_engine`` builds the LLMEngine; it runs on the engine thread, which then owns it."""
        self._make_engine = make_engine
        self.model_name = model_name
        self._inputs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders "submit" against "the thread has died"
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stats: dict = {}
        self.tokenizer = None
        self.max_model_len: Optional[int] = None
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        from kiln.runtime.engine import LLMEngine

        return cls(lambda: LLMEngine(config), model_name=config.model.model)

    # ---- state ----------------------------------------------------------------------------------
    def is_ready(self) -> bool:
        """The engine is built and its thread is running."""
        return self._ready.is_set() and self.is_healthy()

    def is_healthy(self) -> bool:
        """False once the thread has crashed or been shut down."""
        return self._error is None and not self._done.is_set()

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Block until the engine is built; raise EngineDeadError if building it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self._ready.is_set() or self._done.is_set()):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine is not ready after {timeout} s")
            self._done.wait(0.05)
        if not self.is_ready():
            raise self._dead_error()

    def stats(self) -> dict:
        """LLMEngine.stats() as of the engine thread's latest turn (empty before it is ready)."""
        return dict(self._stats)

    # ---- requests -------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> RequestStream:
        """Hand a request to the engine; raise its ValueError if the engine refuses it."""
        sink = _Sink(asyncio.get_running_loop())
        self._submit(_Add(request_id, prompt, params, priority, add_special_tokens, sink))
        try:
            first = await sink.queue.get()
        except BaseException:
            self.abort(request_id)  # cancelled while waiting: the engine may still take it
            raise
        if isinstance(first, BaseException):
            raise first
        return RequestStream(self, request_id, sink)

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes; leaving early aborts it."""
        stream = await self.add_request(request_id, prompt, params, priority, add_special_tokens)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Finish a request now and free its blocks. Safe from any thread; unknown ids are ignored."""
        try:
            self._submit(_Abort(request_id))
        except EngineDeadError:
            pass  # a dead engine holds nothing

    def shutdown(self, timeout: Optional[float] = 30.0) -> None:
        """Fail unfinished requests, shut the LLMEngine down and join its thread."""
        with self._lock:
            if not (self._done.is_set() or self._stopping):
                self._inputs.put(_Stop())
                self._stopping = True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _submit(self, message) -> None:
        with self._lock:
            if self._done.is_set() or self._stopping:
                raise self._dead_error()
            self._inputs.put(message)

    def _dead_error(self) -> EngineDeadError:
        if self._error is not None:
            return EngineDeadError(f"the engine has stopped after an error: {self._error!r}")
        return EngineDeadError("the engine has shut down")

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = None
        try:
            engine = self._make_engine()
            self.tokenizer = engine.tokenizer
            self.max_model_len = engine.max_model_len
            self._stats = engine.stats()
            self._ready.set()
            self._loop(engine)
            self._close(EngineDeadError("the engine has shut down"))
        except BaseException as e:  # noqa: BLE001 - any crash must reach the waiting requests
            logger.exception("engine thread died")
            self._error = e
            self._close(self._dead_error())
        finally:
            if engine is not None:
                try:
                    engine.shutdown()
                except Exception:  # noqa: BLE001 - already on the way out
                    logger.exception("engine shutdown failed")

    def _loop(self, engine) -> None:
        while True:
            busy = engine.has_unfinished_requests()
            if not self._take_inputs(engine, block=not busy):
                return
            if engine.has_unfinished_requests():
                self._deliver(engine.step())
            self._stats = engine.stats()

    def _take_inputs(self, engine, block: bool) -> bool:
        """Apply queued adds and aborts (waiting for one if ``block``); False on stop."""
        while True:
            try:
                message = self._inputs.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(message, _Stop):
                return False
            if isinstance(message, _Abort):
                self._abort(engine, message.request_id)
                continue
            try:
                engine.add_request(
                    message.request_id, message.prompt, message.params, message.priority,
                    message.add_special_tokens,
                )
            except ValueError as e:
                _post({message.sink: [e]})
                continue
            self._sinks[message.request_id] = message.sink
            _post({message.sink: [_ACCEPTED]})

    def _abort(self, engine, request_id: str) -> None:
        out = engine.abort_request(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None and out is not None:
            _post({sink: [out]})  # someone other than the consumer may have aborted it

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch: dict[_Sink, list] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            batch.setdefault(sink, []).append(out)
            if out.finished:
                del self._sinks[out.request_id]
        for sink in _post(batch):
            # Its event loop is gone, so nobody will read it.
            for rid, s in list(self._sinks.items()):
                if s is sink:
                    self._inputs.put(_Abort(rid))

    def _close(self, error: EngineDeadError) -> None:
        """Stop taking requests and fail every pending one with ``error``."""
        with self._lock:
            self._done.set()
            batch: dict[_Sink, list] = {sink: [error] for sink in self._sinks.values()}
            self._sinks.clear()
            while True:
                try:
                    message = self._inputs.get_nowait()
                except queue.Empty:
                    break
                if isinstance(message, _Add):
                    batch[message.sink] = [error]
        _post(batch)


def _post(batch: dict[_Sink, list]) -> list[_Sink]:
    """Put items on their sinks' queues, one wake-up per event loop; return sinks whose loop closed."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, list]]] = {}
    for sink, items in batch.items():
        by_loop.setdefault(sink.loop, []).append((sink, items))
    lost = []
    for loop, entries in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, entries)
        except RuntimeError:
            lost.extend(sink for sink, _ in entries)
    return lost


def _put_all(entries: list[tuple[_Sink, list]]) -> None:
    for sink, items in entries:
        for item in items:
            sink.queue.put_nowait(item)
