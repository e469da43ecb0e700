"""AsyncEngine: the in-process engine client, one LLMEngine on a thread of the caller's process.

    engine = AsyncEngine.from_config(config)
    engine.wait_ready()
    async for out in engine.generate("req-1", "Hello", SamplingParams(max_tokens=8)):
        print(out.outputs[0].text)     # cumulative (kiln.engine.streams)

The server runs its engine in a process of its own (``EngineCoreClient``), with the same interface;
this client serves engines that live in the caller's process: stand-in engines in tests, and tests
that reach into a real engine (a monkeypatch, its log). The engine thread shares the caller's GIL.

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
- No one request can stop the thread. A request is tokenized and checked on the caller's thread
  (``InputProcessor``; ValueError), then admitted against ``QueueLimits`` (QueueFullError). On the
  thread, anything it raises while being added is its own error (ValueError as it is, anything
  else a logged RequestFailedError) and leaves nothing behind; a request that fails while its
  output is processed ends with ``RequestOutput.error``, delivered as a RequestFailedError.
- Every admitted request gets an answer: its outputs, its error, or EngineDeadError. Its share of
  the queue limits is given back when it leaves (finished, failed, refused, aborted).
- If the thread dies with an exception (a failed step: the device, a rank), every pending and later
  request raises EngineDeadError and ``is_healthy()`` turns False: nobody waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Union

from kiln.config import EngineConfig
from kiln.engine.streams import (
    ACCEPTED, ClientState, EngineDeadError, QueueFullError, QueueLimits, RequestFailedError, RequestStream, Sink,
    post,
)
from kiln.outputs import RequestDelta, RequestOutput
from kiln.runtime.input_processor import TokenizedPrompt
from kiln.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int], TokenizedPrompt]

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "QueueLimits", "RequestFailedError", "RequestStream"]


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int
    add_special_tokens: bool
    sink: Sink
    pooling: Optional[str] = None


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncEngine(ClientState):
    def __init__(self, make_engine: Callable[[], object], model_name: Optional[str] = None,
                 limits: QueueLimits = QueueLimits(), deltas: bool = False):
        """``make_engine`` builds the LLMEngine; it runs on the engine thread, which then owns it.
        ``deltas``: the engine's outputs are deltas (``LLMEngine(delta_outputs=True)``)."""
        self._make_engine = make_engine
        super().__init__(limits)  # its _sinks: the engine thread's only
        self.model_name = model_name
        self._deltas = deltas
        self._input_processor = None  # the engine's InputProcessor, once built: safe from any thread
        self._inputs: queue.Queue = queue.Queue()
        self._stats: dict = {}
        self._building = lambda: False  # the engine's live LLMEngine.building, once it exists
        self.tokenizer = None
        self.max_model_len: Optional[int] = None
        self.eos_token_ids: tuple[int, ...] = ()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        from kiln.runtime.engine import LLMEngine

        return cls(lambda: LLMEngine(config, delta_outputs=True), model_name=config.model.model,
                   limits=QueueLimits.from_server(config.server), deltas=True)

    # ---- state ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        """LLMEngine.stats() as of the engine thread's latest turn (empty before it is ready), and
        what is admitted now against the queue limits (``num_queued_seqs``, ``num_queued_tokens``), and
        ``compile_building``, ``LLMEngine.building`` read now (a build can end while the engine thread
        waits for requests, so the engine's own stats would keep it stale)."""
        return {**self._stats, **self._admission.counts(), "compile_building": int(self._building())}

    # ---- requests -------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        add_special_tokens: bool = True,
        pooling: Optional[str] = None,
    ) -> RequestStream:
        """Hand a request to the engine. Raises ValueError for bad input (checked here, on the
        caller's thread, then on the engine's), QueueFullError when the queue is at a limit,
        RequestFailedError when kiln failed it, EngineDeadError when the engine has stopped."""
        prompt = self.process(prompt, params, add_special_tokens)
        sink = Sink(asyncio.get_running_loop(), params.n, params.n * _num_tokens(prompt),
                    *((prompt.text, prompt.token_ids) if isinstance(prompt, TokenizedPrompt) else ()))
        self._submit(_Add(request_id, prompt, params, priority, add_special_tokens, sink, pooling), reserve=sink)
        return await self._accepted(request_id, sink, self._deltas)

    @property
    def grammars(self):
        """The engine's ``GrammarCompiler`` (thread-safe), or None before the engine is built."""
        return getattr(self._input_processor, "grammars", None)

    def process(self, prompt: Prompt, params: SamplingParams, add_special_tokens: bool = True) -> Prompt:
        """Tokenize and check a prompt on the caller's thread (ValueError for bad input). Before the
        engine is built, or for an engine without an InputProcessor, the prompt passes as it is."""
        inputs = self._input_processor
        return inputs.process(prompt, params, add_special_tokens) if inputs is not None else prompt

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

    def _submit(self, message, reserve: Optional[Sink] = None) -> None:
        with self._lock:
            if self._done.is_set() or self._stopping:
                raise self._dead_error()
            if reserve is not None:
                self._admission.reserve(reserve)
            self._inputs.put(message)

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = None
        try:
            engine = self._make_engine()
            self.tokenizer = engine.tokenizer
            self.max_model_len = engine.max_model_len
            self.eos_token_ids = tuple(getattr(getattr(engine, "executor", None), "eos_token_ids", ()))
            self._input_processor = getattr(engine, "inputs", None)  # test stand-ins have none
            self._building = lambda: bool(getattr(engine, "building", False))
            self._stats = engine.stats()
            self._ready.set()
            self._loop(engine)
            self._close(EngineDeadError("the engine shut down before this request finished"))
        except BaseException as e:  # noqa: BLE001 - any crash must reach the waiting requests
            if self._ready.is_set():
                logger.exception("engine thread died")
            # else building it failed: wait_ready re-raises the error itself (a bad setting's
            # ValueError says what to change), and every later request names it
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
            # Idle with CUDA graphs left to capture (lazy capture): one size, then the inputs again.
            capturing = not busy and getattr(engine, "has_pending_captures", False)
            if not self._take_inputs(engine, block=not busy and not capturing):
                return
            if engine.has_unfinished_requests():
                self._deliver(engine.step())
            elif capturing:
                engine.capture_idle()
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
            else:
                self._add(engine, message)

    def _add(self, engine, message: _Add) -> None:
        """Add one request; whatever it raises is its own answer (LLMEngine.add_request cleans up)."""
        try:
            engine.add_request(message.request_id, message.prompt, message.params, message.priority,
                               message.add_special_tokens, **({"pooling": message.pooling} if message.pooling else {}))
        except Exception as e:  # noqa: BLE001 - one request must not stop the engine thread
            if not isinstance(e, ValueError):
                logger.exception("request %s failed while it was added", message.request_id)
                e = RequestFailedError(message.request_id, f"{type(e).__name__}: {e}")
            self._admission.release(message.sink)
            post({message.sink: [e]})
            return
        self._sinks[message.request_id] = message.sink
        post({message.sink: [ACCEPTED]})

    def _abort(self, engine, request_id: str) -> None:
        try:
            out = engine.abort_request(request_id)
        except Exception as e:  # noqa: BLE001 - answer the request anyway
            logger.exception("aborting request %s failed", request_id)
            out = RequestFailedError(request_id, f"{type(e).__name__} while aborting: {e}")
        sink = self._drop(request_id)
        if sink is not None and out is not None:
            post({sink: [out]})  # someone other than the consumer may have aborted it

    def _drop(self, request_id: str) -> Optional[Sink]:
        """Forget a request that left the engine, giving its share of the queue limits back."""
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            self._admission.release(sink)
        return sink

    def _deliver(self, outputs: list[Union[RequestOutput, RequestDelta]]) -> None:
        batch: dict[Sink, list] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            item = out if out.error is None else RequestFailedError(out.request_id, out.error)
            batch.setdefault(sink, []).append(item)
            if out.finished:
                self._drop(out.request_id)
        for sink in post(batch):
            # Its event loop is gone, so nobody will read it.
            for rid, s in list(self._sinks.items()):
                if s is sink:
                    self._inputs.put(_Abort(rid))

    def _close(self, error: EngineDeadError) -> None:
        super()._close(error, self._take_queued_adds)

    def _take_queued_adds(self) -> list[Sink]:
        """The sinks of adds still in the input queue (emptied), which the engine never saw."""
        sinks = []
        while True:
            try:
                message = self._inputs.get_nowait()
            except queue.Empty:
                return sinks
            if isinstance(message, _Add):
                sinks.append(message.sink)


def _num_tokens(prompt: Prompt) -> int:
    return len(prompt.token_ids) if isinstance(prompt, TokenizedPrompt) else len(prompt)
