"""The engine-core process: one LLMEngine and a busy loop that never waits on a client.

    EngineCoreClient (frontend 0)  ── AddRequest | AbortRequests | Shutdown ──►  EngineCore.run()
    EngineCoreClient (frontend 1)  ◄── Ready, then StepOutputs ... Stopped ────
    ...                            (one socket pair per frontend: server.api_server_count)

One turn of the loop::

    take inputs   adds, aborts, shutdown (waits for one only when idle: nothing unfinished, no capture)
    step          LLMEngine.step() -> RequestDeltas                  (busy)
    or capture    one pending CUDA-graph size                        (idle, lazy capture)
    send          StepOutputs: the deltas, requests taken or refused, stats every STATS_PERIOD_S

Rules:
- Requests arrive tokenized and checked by the frontend (``InputProcessor``); one the engine still
  refuses is answered with a ``Refusal`` and leaves nothing behind. Aborts free blocks at once.
- Each request's outputs go back to the frontend that sent it; stats, ``Ready`` and ``Stopped`` to
  every frontend. A frontend's ``Shutdown`` aborts its unfinished requests and answers it
  ``Stopped``; the process leaves once every frontend has shut down.
- Nothing here waits on a client: outputs go out on a PUSH socket without a high-water mark, and
  the loop blocks only when it has nothing to run.
- A failed step ends the process after ``Stopped(error)``, so the frontend fails every pending
  request at once. The process also leaves on ``Shutdown`` and when its parent (the frontend) is
  gone, checked every ``PARENT_CHECK_S``: a killed frontend leaves no engine holding the device.
- SIGINT and SIGTERM belong to the frontend, which drains and then sends ``Shutdown``; the process
  ignores both (a signal to the process group would otherwise cut the drain short; the spawn's
  target in ``kiln.engine.launch`` sets that up, with the log level and a replica's placement).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import time
from typing import Callable, Optional

import zmq

from kiln.config import EngineConfig
from kiln.engine.messages import (
    AbortRequests, AddRequest, LoadLora, Ready, Refusal, Shutdown, StartFailed, StepOutputs, Stopped, UnloadLora,
    encoder, to_engine_decoder,
)
from kiln.outputs import RequestDelta
from kiln.runtime.engine import LLMEngine
from kiln.runtime.input_processor import TokenizedPrompt

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # an idle loop wakes this often: stats, the parent check
STATS_PERIOD_S = 0.1  # a busy loop sends the engine's stats at most this often
PARENT_CHECK_S = 1.0


class EngineCore:
    """The busy loop over one built LLMEngine (``delta_outputs=True``) and one input and one output
    socket per frontend (``inputs[i]`` and ``outputs[i]`` belong to frontend ``i``)."""

    def __init__(self, engine: LLMEngine, inputs: list[zmq.Socket], outputs: list[zmq.Socket],
                 parent_alive: Callable[[], bool] = lambda: True):
        self.engine = engine
        self._inputs = inputs
        self._outputs = outputs
        self._parent_alive = parent_alive
        self._encode = encoder().encode
        self._decode = to_engine_decoder().decode
        self._poller = zmq.Poller()
        for socket in inputs:
            self._poller.register(socket, zmq.POLLIN)
        self._live = set(range(len(inputs)))  # frontends that have not shut down
        self._owner: dict[str, int] = {}  # request id -> the frontend it came from
        self._accepted: list[list[str]] = [[] for _ in inputs]
        self._refused: list[list[Refusal]] = [[] for _ in inputs]
        self._next_stats_at = 0.0
        self._next_parent_check_at = 0.0

    def run(self) -> bool:
        """Serve until every frontend has shut down (True) or the parent's exit (False); a failed
        step raises."""
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            capturing = not busy and engine.has_pending_captures
            if not self._take_inputs(0 if busy or capturing else IDLE_POLL_MS):
                return True
            outputs: list[RequestDelta] = []
            if engine.has_unfinished_requests():
                outputs = engine.step()
            elif capturing:
                engine.capture_idle()
            # Gone idle: the stats now, so /metrics shows the blocks given back.
            self._send(outputs, force_stats=busy and not engine.has_unfinished_requests())
            if not self._check_parent():
                logger.warning("the frontend process is gone; the engine core stops")
                return False

    def _take_inputs(self, timeout_ms: int) -> bool:
        """Apply every waiting add and abort (waiting up to ``timeout_ms`` for the first); False
        once every frontend has sent Shutdown."""
        for socket, _ in self._poller.poll(timeout_ms):
            client = self._inputs.index(socket)
            while client in self._live:
                try:
                    frame = socket.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                message = self._decode(frame.buffer)
                if isinstance(message, Shutdown):
                    self._leave(client)
                elif isinstance(message, (LoadLora, UnloadLora)):
                    self._lora_op(client, message)
                elif isinstance(message, AbortRequests):
                    for request_id in message.request_ids:
                        self._owner.pop(request_id, None)
                        self.engine.abort_request(request_id)  # its client has stopped listening
                else:
                    self._add(client, message)
        return bool(self._live)

    def _leave(self, client: int) -> None:
        """A frontend shut down: its unfinished requests go, and it hears Stopped."""
        for request_id in [r for r, c in self._owner.items() if c == client]:
            del self._owner[request_id]
            self.engine.abort_request(request_id)
        self._live.discard(client)
        self._poller.unregister(self._inputs[client])
        self._outputs[client].send(self._encode(Stopped()))

    def _add(self, client: int, message: AddRequest) -> None:
        try:
            prompt = TokenizedPrompt(message.prompt, message.prompt_token_ids, tuple(message.mm_features))
            self.engine.add_request(message.request_id, prompt,
                                    message.params, message.priority, pooling=message.pooling,
                                    lora_request=message.lora_request)
        except ValueError as e:
            self._refused[client].append(Refusal(message.request_id, True, str(e)))
        except Exception as e:  # noqa: BLE001 - one request must not stop the engine
            logger.exception("request %s failed while it was added", message.request_id)
            self._refused[client].append(Refusal(message.request_id, False, f"{type(e).__name__}: {e}"))
        else:
            self._owner[message.request_id] = client
            self._accepted[client].append(message.request_id)

    def _lora_op(self, client: int, message: "LoadLora | UnloadLora") -> None:
        """Load or unload an adapter between steps; the answer travels as a request's would."""
        try:
            if isinstance(message, LoadLora):
                self.engine.add_lora(message.lora)
            else:
                self.engine.remove_lora(message.lora_int_id)
        except ValueError as e:
            self._refused[client].append(Refusal(message.op_id, True, str(e)))
        except Exception as e:  # noqa: BLE001 - a bad adapter must not stop the engine
            logger.exception("LoRA operation %s failed", message.op_id)
            self._refused[client].append(Refusal(message.op_id, False, f"{type(e).__name__}: {e}"))
        else:
            self._accepted[client].append(message.op_id)

    def _send(self, outputs: list[RequestDelta], force_stats: bool = False) -> None:
        now = time.monotonic()
        stats = None
        if now >= self._next_stats_at or force_stats:
            self._next_stats_at = now + STATS_PERIOD_S
            stats = {**self.engine.stats(), "compile_building": int(self.engine.building)}
        by_client: dict[int, list[RequestDelta]] = {}
        for out in outputs:
            client = self._owner.pop(out.request_id, None) if out.finished else self._owner.get(out.request_id)
            if client is not None:  # else aborted: its frontend has forgotten it
                by_client.setdefault(client, []).append(out)
        for client in self._live:
            mine = by_client.get(client, [])
            if not (mine or self._accepted[client] or self._refused[client] or stats):
                continue
            message = StepOutputs(mine, self._accepted[client], self._refused[client], stats)
            self._accepted[client], self._refused[client] = [], []
            self._outputs[client].send(self._encode(message), copy=False)

    def stopped(self, error: Optional[str]) -> None:
        """Tell every frontend still listening that the engine core is leaving."""
        for client in self._live:
            self._outputs[client].send(self._encode(Stopped(error)))
        self._live.clear()

    def _check_parent(self) -> bool:
        now = time.monotonic()
        if now < self._next_parent_check_at:
            return True
        self._next_parent_check_at = now + PARENT_CHECK_S
        return self._parent_alive()


def run_engine_core(config: EngineConfig, addresses: list[tuple[str, str]]) -> None:
    """The engine-core process's work (``kiln.engine.launch`` spawns it): build the engine, say
    Ready (or StartFailed) to every frontend, serve, say Stopped. ``addresses`` holds each
    frontend's (input, output) endpoints."""
    ctx = zmq.Context()
    inputs, outputs = [], []
    for input_address, output_address in addresses:
        inputs.append(ctx.socket(zmq.PULL))
        inputs[-1].setsockopt(zmq.RCVHWM, 0)
        inputs[-1].connect(input_address)
        outputs.append(ctx.socket(zmq.PUSH))
        outputs[-1].setsockopt(zmq.SNDHWM, 0)
        outputs[-1].connect(output_address)
    encode = encoder().encode
    try:
        try:
            engine = LLMEngine(config, delta_outputs=True)
        except BaseException as e:  # noqa: BLE001 - the frontend re-raises it (a ValueError says what to change)
            if not isinstance(e, ValueError):
                logger.exception("building the engine failed")
            for socket in outputs:
                socket.send(encode(StartFailed(type(e).__name__, str(e))))
            return
        _serve(engine, inputs, outputs, encode)
    finally:
        for socket in inputs:
            socket.close(linger=0)
        for socket in outputs:
            socket.close(linger=5000)  # the last messages (Stopped, StartFailed) still go out
        ctx.term()


def _serve(engine: LLMEngine, inputs: list[zmq.Socket], outputs: list[zmq.Socket], encode) -> None:
    error = None
    parent = multiprocessing.parent_process()
    core = EngineCore(engine, inputs, outputs, parent.is_alive if parent is not None else (lambda: True))
    try:
        executor = engine.executor
        processor = pickle.dumps(engine.mm_processor.processor) if engine.mm_processor is not None else b""
        ready = encode(Ready(pickle.dumps(engine.tokenizer), executor.vocab_size, engine.max_model_len,
                             list(executor.eos_token_ids), engine.startup, processor))
        for socket in outputs:
            socket.send(ready)
        if not core.run():
            _remove_socket_dir(inputs[0])  # the frontend that made it cannot
    except BaseException as e:  # noqa: BLE001 - reported to the frontends, which fail what is pending
        logger.exception("the engine core failed")
        error = f"{type(e).__name__}: {e}"
    finally:
        core.stopped(error)  # before the shutdown, which can take a while
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - already on the way out
            logger.exception("engine shutdown failed")


def _remove_socket_dir(socket: zmq.Socket) -> None:
    endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    if endpoint.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(endpoint.removeprefix("ipc://")), ignore_errors=True)
