"""One tensor-parallel rank in its own process: the loop a ``MultiprocExecutor`` worker runs.

Protocol over one duplex pipe per rank (messages are pickled once by the executor, sent as bytes):

    executor ─ ("execute", SchedulerOutput) ─> every rank ─ forward (all-reduces between ranks)
    executor <─ ("ok", RunnerOutput | None) ── rank 0 samples and answers with tokens, others None
    executor ─ ("forget", [request ids]) ────> rank 0 only (the sampler lives there), no answer
    executor ─ ("shutdown", None) ───────────> every rank: leave the loop, destroy the group, exit

Rules kept here:
- Every failure is answered, never swallowed: ("error", exception, traceback text), then exit.
- A worker never outlives the engine: it exits when its pipe closes or its parent process is gone.
- The process group is initialized before the model is built (the KV block count is agreed by an
  all-reduce during start-up) and destroyed on the way out.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch

from kiln.config import CacheConfig, CompileConfig, ModelConfig, SchedulerConfig
from kiln.models.parallel import TensorParallel

_PARENT_CHECK_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to start: its sub-configs, its place and where the group meets."""

    model: ModelConfig
    cache: CacheConfig
    compile: CompileConfig
    scheduler: Optional[SchedulerConfig]
    tp: TensorParallel
    init_method: str  # e.g. tcp://127.0.0.1:<port>
    collective_timeout_s: float


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a spawned rank process."""
    parent_pid = os.getppid()
    try:
        runner = _start(spec)
        conn.send(("ready", _ready_info(runner)))
    except BaseException as exc:  # noqa: BLE001  (reported to the engine, which raises it)
        _report(conn, exc)
        return
    try:
        _serve(runner, conn, parent_pid)
    finally:
        _stop_group()
    # Interpreter teardown with torch loaded takes seconds and has nothing left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start(spec: WorkerSpec):
    import torch.distributed as dist

    from kiln.models.loader import resolve_device
    from kiln.runtime.model_runner import ModelRunner

    device = resolve_device(spec.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(spec.tp.rank)
    else:
        # Ranks share the host's cores; each taking all of them only adds contention.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.tp.size))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=spec.init_method,
                            rank=spec.tp.rank, world_size=spec.tp.size,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
    return ModelRunner(spec.model, spec.cache, spec.compile, spec.scheduler, spec.tp)


def _ready_info(runner) -> dict[str, Any]:
    info: dict[str, Any] = {"num_blocks": runner.num_blocks}
    if runner.tp.rank == 0:
        info.update(max_model_len=runner.max_model_len, tokenizer=runner.tokenizer, arch=runner.arch)
    return info


def _serve(runner, conn: Connection, parent_pid: int) -> None:
    while True:
        if not conn.poll(_PARENT_CHECK_S):
            if os.getppid() != parent_pid:  # the engine died without a word: do not linger
                return
            continue
        try:
            method, arg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if method == "shutdown":
            return
        try:
            if method == "execute":
                out = runner.execute(arg)
                conn.send(("ok", out if runner.tp.rank == 0 else None))
            elif method == "forget":
                for request_id in arg:
                    runner.forget(request_id)
            else:
                raise ValueError(f"unknown worker message {method!r}")
        except BaseException as exc:  # noqa: BLE001
            _report(conn, exc)
            return


def _report(conn: Connection, exc: BaseException) -> None:
    text = traceback.format_exc()
    try:
        conn.send(("error", exc, text))
    except Exception:  # noqa: BLE001  (the exception itself may not pickle)
        try:
            conn.send(("error", RuntimeError(repr(exc)), text))
        except (OSError, EOFError):
            pass


def _stop_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (a peer already gone must not turn exit into a hang)
            pass
