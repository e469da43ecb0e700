"""EngineCoreClient: the frontend's handle on an engine core running in a process of its own.

    client = EngineCoreClient(config)          # spawns the engine-core process (kiln.engine.core)
    client.wait_ready()                        # the model is loaded; tokenizer and limits are here
    stream = await client.add_request("req-1", "Hello", SamplingParams(max_tokens=8))
    async for out in stream: ...               # cumulative outputs, merged from the engine's deltas

Threads and rules (the frontend side; the engine side is ``kiln.engine.core``):
- Requests are tokenized and checked here, on the caller's thread (``InputProcessor`` over the
  engine's own tokenizer, which ``Ready`` carries), and admitted against ``QueueLimits`` (429)
  before they are sent; the engine answers each with "taken" or a refusal, which ``add_request``
  awaits, so a refusal is an error before any byte of the answer.
- One reader thread receives and decodes everything the engine sends and hands each request's
  items to its event loop (``streams.post``: one wake-up per loop per message). Sends happen on the
  caller's thread under one lock; nothing here waits for the engine except ``add_request``'s
  acceptance and ``wait_ready``.
- ``abort`` is synchronous, safe from any thread or a ``finally``: the request is forgotten here
  at once (its share of the queue limits given back) and the engine frees its blocks on its next turn.
- Every admitted request gets an answer: its outputs, its refusal, or EngineDeadError. When the
  engine-core process dies (a failed step, a kill) every pending and later request fails at once,
  ``is_healthy()`` turns False and ``on_dead`` is called, so the server can exit non-zero.
- The engine-core process is spawned by ``kiln.engine.launch.EngineCoreProcess``, here or earlier
  (``kiln serve`` spawns it before importing the server, so both start side by side). Several
  frontends can share one engine core (``server.api_server_count``): ``EngineCoreProcess`` starts
  it with one socket pair per frontend, and each frontend process attaches its client to
  its own pair (``EngineCoreClient(config, shared=...)``). The process belongs to whoever started
  it; an attached client's ``shutdown`` detaches (the engine core leaves after the last).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import pickle
import shutil
import threading
import weakref
from typing import Callable, Optional

import zmq

from kiln.clock import process_age_s
from kiln.config import EngineConfig
from kiln.lora_request import LoRARequest
from kiln.engine.launch import EngineCoreAddress, EngineCoreProcess, ReplicaPlacement, address
from kiln.engine.messages import (
    AbortRequests, AddRequest, LoadLora, Ready, Shutdown, StartFailed, StepOutputs, Stopped, UnloadLora, encoder,
    from_engine_decoder,
)
from kiln.engine.streams import (
    ACCEPTED, ClientState, EngineDeadError, QueueLimits, RequestFailedError, RequestStream, Sink, post,
)
from kiln.runtime.engine import StartupReport
from kiln.runtime.input_processor import InputProcessor, Prompt, TokenizedPrompt
from kiln.runtime.multimodal import MultimodalProcessor
from kiln.runtime.structured_output import GrammarCompiler
from kiln.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

LIVENESS_POLL_MS = 200  # how often the reader checks the process while the engine is silent

# Clients not yet shut down. At interpreter exit multiprocessing joins the engine-core processes,
# which wait for their frontend: shutting the clients down first (atexit runs last-registered first)
# lets a script that never called shutdown() exit.
_LIVE: "weakref.WeakSet[EngineCoreClient]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_clients() -> None:
    for client in list(_LIVE):
        client.shutdown(timeout=5)


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, which still answers signals, has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class EngineCoreClient(ClientState):
    def __init__(self, config: EngineConfig, model_name: Optional[str] = None,
                 limits: QueueLimits = QueueLimits(), on_dead: Optional[Callable[[], None]] = None,
                 shared: Optional[EngineCoreAddress] = None, placement: Optional[ReplicaPlacement] = None,
                 started: Optional[EngineCoreProcess] = None):
        """Start the engine-core process for ``config`` (``placement``: as one data-parallel
        replica), or own ``started``, spawned earlier for one frontend, or, with ``shared``, attach
        to a process with several; ``on_dead`` runs (on the reader thread) if the engine stops
        without being asked to."""
        super().__init__(limits)  # its _lock also guards the input socket
        self.model_name = model_name or config.model.model
        self._on_dead = on_dead
        self._shutdown_lock = threading.Lock()
        self._shut = False
        self._stats: dict = {}
        self._inputs: Optional[InputProcessor] = None
        self.tokenizer = None
        self.max_model_len: Optional[int] = None
        self.eos_token_ids: tuple[int, ...] = ()  # the model's, once ready (beam search ends beams on them)
        self.startup: Optional[StartupReport] = None
        self._encode = encoder().encode

        self._shared = shared
        if shared is None and started is None:
            started = EngineCoreProcess(config, 1, placement)
        self._ipc_dir = shared.ipc_dir if shared is not None else started.ipc_dir
        input_address, output_address = address(self._ipc_dir, shared.index if shared is not None else 0)
        # The process-wide context, never terminated: a client dropped without shutdown is garbage
        # collected with its sockets, and a context's finalizer can run before theirs and wait for
        # them forever. Unsent messages are dropped on close (LINGER 0): their engine core is gone.
        ctx = zmq.Context.instance()
        self._to_engine = ctx.socket(zmq.PUSH)
        self._to_engine.setsockopt(zmq.LINGER, 0)
        self._to_engine.setsockopt(zmq.SNDHWM, 0)
        self._to_engine.bind(input_address)
        self._from_engine = ctx.socket(zmq.PULL)
        self._from_engine.setsockopt(zmq.LINGER, 0)
        self._from_engine.setsockopt(zmq.RCVHWM, 0)
        self._from_engine.bind(output_address)
        self._proc: Optional[multiprocessing.Process] = None
        if shared is None:
            self.age_at_spawn = started.age_at_spawn  # where the engine core's own start-up clock begins
            self._proc = started.process
            self._engine_pid = self._proc.pid
        else:
            self.age_at_spawn = shared.age_at_spawn
            self._engine_pid = shared.engine_pid
        self._reader = threading.Thread(target=self._read, name="kiln-engine-client", daemon=True)
        self._reader.start()
        _LIVE.add(self)

    # ---- state ----------------------------------------------------------------------------------
    @property
    def grammars(self) -> Optional[GrammarCompiler]:
        return self._inputs.grammars if self._inputs is not None else None

    @property
    def pid(self) -> Optional[int]:
        """The engine-core process's id."""
        return self._engine_pid

    def _engine_alive(self) -> bool:
        return self._proc.is_alive() if self._proc is not None else _running(self._engine_pid)

    def _engine_exit(self) -> str:
        return f"code {self._proc.exitcode}" if self._proc is not None else f"pid {self._engine_pid}"

    @property
    def ipc_dir(self) -> str:
        """The directory of the two sockets; removed by ``shutdown``, or by an engine core whose
        frontend is gone."""
        return self._ipc_dir

    def stats(self) -> dict:
        """The engine's stats as of its latest message (empty before it is ready), and what is
        admitted now against the queue limits."""
        return {**self._stats, **self._admission.counts()}

    def holds(self, request_id: str) -> bool:
        """Whether a request of this id is unfinished here."""
        return request_id in self._sinks

    @property
    def reads_images(self) -> bool:
        """Whether the model takes images (a vision-language model's processor came with ``Ready``)."""
        return self._inputs is not None and self._inputs.mm_processor is not None

    # ---- requests -------------------------------------------------------------------------------
    def process(self, prompt: Prompt, params: SamplingParams, add_special_tokens: bool = True) -> TokenizedPrompt:
        """Tokenize and check a prompt on the caller's thread (ValueError for bad input)."""
        if self._inputs is None:
            raise self._dead_error() if self._done.is_set() else EngineDeadError("the engine is still loading")
        return self._inputs.process(prompt, params, add_special_tokens)

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
                          add_special_tokens: bool = True, pooling: Optional[str] = None,
                          lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Hand a request to the engine (``lora_request``: the adapter it runs with). Raises ValueError for bad input, QueueFullError when the
        queue is at a limit, RequestFailedError when kiln failed it, EngineDeadError when the engine
        has stopped."""
        processed = self.process(prompt, params, add_special_tokens)
        ids = processed.token_ids
        sink = Sink(asyncio.get_running_loop(), params.n, params.n * len(ids), processed.text, ids)
        message = AddRequest(request_id, processed.text, ids, params, priority, pooling, lora_request,
                             list(processed.mm_features))
        with self._lock:
            if self._done.is_set() or self._stopping:
                raise self._dead_error()
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._admission.reserve(sink)
            self._sinks[request_id] = sink
            self._to_engine.send(self._encode(message), copy=False)
        return await self._accepted(request_id, sink, True)

    async def add_lora(self, lora: LoRARequest) -> None:
        """Have the engine read and check an adapter now (ValueError naming the file and field)."""
        await self._lora_op(LoadLora(f"lora-load-{lora.lora_int_id}-{os.urandom(4).hex()}", lora))

    async def remove_lora(self, lora_int_id: int) -> None:
        await self._lora_op(UnloadLora(f"lora-unload-{lora_int_id}-{os.urandom(4).hex()}", lora_int_id))

    async def _lora_op(self, message) -> None:
        sink = Sink(asyncio.get_running_loop())
        with self._lock:
            if self._done.is_set() or self._stopping:
                raise self._dead_error()
            self._sinks[message.op_id] = sink
            self._to_engine.send(self._encode(message), copy=False)
        try:
            first = await sink.queue.get()
        finally:
            with self._lock:
                self._sinks.pop(message.op_id, None)
        if isinstance(first, BaseException):
            raise first

    def abort(self, request_id: str) -> None:
        """Finish a request now and free its blocks. Safe from any thread; unknown ids are ignored."""
        with self._lock:
            sink = self._sinks.pop(request_id, None)
            if sink is not None and not self._done.is_set():
                self._to_engine.send(self._encode(AbortRequests([request_id])), copy=False)
        if sink is not None:
            self._admission.release(sink)

    def shutdown(self, timeout: Optional[float] = 30.0) -> None:
        """Fail unfinished requests, stop the engine-core process and wait for it (an attached
        client: detach from it). Safe from any thread and more than once (the server's drain timer
        and its exit both call it): a second call waits for the first to end."""
        with self._shutdown_lock:
            if not self._shut:
                self._shutdown(timeout)
                self._shut = True
                _LIVE.discard(self)

    def _shutdown(self, timeout: Optional[float]) -> None:
        with self._lock:
            if not (self._done.is_set() or self._stopping):
                self._stopping = True
                self._to_engine.send(self._encode(Shutdown()))
        if self._reader is not threading.current_thread():
            self._reader.join(timeout)
        if self._proc is not None:
            self._proc.join(timeout if self._ready.is_set() else 0)
            if self._proc.is_alive():  # still building (a shutdown during start-up), or stuck
                self._proc.kill()
                self._proc.join(10)
        self._close(EngineDeadError("the engine has shut down"))
        if self._inputs is not None:
            self._inputs.grammars.shutdown()
        if self._reader is not threading.current_thread() and not self._reader.is_alive():
            self._to_engine.close()
            self._from_engine.close()
        if self._shared is None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # ---- reader thread --------------------------------------------------------------------------
    def _read(self) -> None:
        decode = from_engine_decoder().decode
        poller = zmq.Poller()
        poller.register(self._from_engine, zmq.POLLIN)
        try:
            while True:
                if not poller.poll(LIVENESS_POLL_MS):
                    if not self._engine_alive():
                        raise EngineDeadError(f"the engine-core process exited ({self._engine_exit()})")
                    continue
                message = decode(self._from_engine.recv(copy=False).buffer)
                if isinstance(message, StepOutputs):
                    self._deliver(message)
                elif isinstance(message, Ready):
                    self._take_ready(message)
                elif isinstance(message, StartFailed):
                    self._error = (ValueError(message.message) if message.error_type == "ValueError"
                                   else RuntimeError(f"building the engine failed: {message.error_type}: "
                                                     f"{message.message}"))
                    return
                elif isinstance(message, Stopped):
                    if message.error is not None:
                        self._error = RuntimeError(message.error)
                    return
        except BaseException as e:  # noqa: BLE001 - any end must reach the waiting requests
            self._error = e
        finally:
            unexpected = not self._stopping
            self._close(self._dead_error())
            if unexpected and self._ready.is_set():
                logger.error("the engine core stopped: %s", self._error)
                if self._on_dead is not None:
                    self._on_dead()

    def _take_ready(self, ready: Ready) -> None:
        tokenizer = pickle.loads(ready.tokenizer_pickle)
        grammars = GrammarCompiler(tokenizer, ready.vocab_size, ready.eos_token_ids or None)
        images = MultimodalProcessor(pickle.loads(ready.processor_pickle)) if ready.processor_pickle else None
        self._inputs = InputProcessor(tokenizer, ready.vocab_size, ready.max_model_len, grammars, images)
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.eos_token_ids = tuple(ready.eos_token_ids)
        owner = self._shared.owner_pid if self._shared is not None else "self"
        self.startup = ready.startup.seen_from(self.age_at_spawn, process_age_s(owner))
        self._ready.set()

    def _deliver(self, message: StepOutputs) -> None:
        if message.stats is not None:
            self._stats = message.stats
        batch: dict[Sink, list] = {}
        left: list[Sink] = []
        with self._lock:
            for request_id in message.accepted:
                sink = self._sinks.get(request_id)
                if sink is not None:
                    batch.setdefault(sink, []).append(ACCEPTED)
            for refusal in message.refused:
                sink = self._sinks.pop(refusal.request_id, None)
                if sink is not None:
                    error = (ValueError(refusal.message) if refusal.bad_input
                             else RequestFailedError(refusal.request_id, refusal.message))
                    batch.setdefault(sink, []).append(error)
                    left.append(sink)
            for out in message.outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                batch.setdefault(sink, []).append(
                    out if out.error is None else RequestFailedError(out.request_id, out.error))
                if out.finished:
                    del self._sinks[out.request_id]
                    left.append(sink)
        for sink in left:
            self._admission.release(sink)
        lost = set(post(batch))
        if lost:  # their event loop is gone, so nobody will read them
            for request_id in [rid for rid, s in list(self._sinks.items()) if s in lost]:
                self.abort(request_id)
