"""One rank (tensor-parallel, pipeline stage, or both) in its own process: the loop a
``MultiprocExecutor`` worker runs.

Protocol over one duplex pipe per rank (messages are pickled once by the executor, sent as bytes):

    executor ─ ("execute", StepDelta) ───────> every rank ─ forward (all-reduces between ranks;
                                               under pipeline parallelism, hidden states stage to stage)
    executor <─ ("ok", RunnerOutput | None) ── tp rank 0 of the last stage samples and answers, others None
    executor ─ ("forget", [request ids]) ────> every rank (mirrors; rank 0's sampler), no answer
    executor ─ ("add_lora", LoRARequest) ────> every rank reads the adapter and keeps its shard
               ("remove_lora", int id)         ("ok", bool) or ("refused", ValueError): it goes on serving
    executor ─ ("shutdown", None) ───────────> every rank: leave the loop, destroy the group, exit

A step travels as a ``StepDelta`` (``kiln.runtime.step_delta``): each rank keeps a mirror of the
live requests, so a steady decode sends a few integers per request, not its whole context.
``RankWorker`` is the rank's state (runner + mirror), the same whether a process loop (``mp``) or a
Ray actor (``ray``) drives it.

Rules kept here:
- Every failure is answered, never swallowed: ("error", exception, traceback text), then exit;
  an adapter a rank refuses is a ("refused", ValueError) answer, not a failure.
- A worker never outlives the engine: it exits when its pipe closes or its parent process is gone.
- The process group (and under pipeline parallelism every stage's tensor-parallel group,
  ``kiln.runtime.pipeline``) is initialized before the model is built (the KV block count is
  agreed by an all-reduce over every rank during start-up) and destroyed on the way out.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch

from kiln.config import CacheConfig, CompileConfig, KernelConfig, LoraConfig, ModelConfig, SchedulerConfig
from kiln.models.parallel import TensorParallel
from kiln.models.pipeline import WHOLE, PipelineStage, global_rank
from kiln.runtime.model_runner import RunnerOutput
from kiln.runtime.step_delta import RequestMirror, StepDelta

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
    all_reduce: str = "nccl"  # parallel.all_reduce
    # The rank's GPU among those this process sees. None: its rank (mp: every rank sees every GPU
    # of the host); a Ray actor sees only the GPU Ray gave it, so it passes 0.
    local_gpu: Optional[int] = None
    stage: PipelineStage = WHOLE  # parallel.pipeline_parallel_size: this rank's stage
    lora: LoraConfig = field(default_factory=LoraConfig)  # every rank holds its shard of each adapter
    kernels: KernelConfig = field(default_factory=KernelConfig)  # set in the rank's process before its runner

    @property
    def rank(self) -> int:
        """The rank in the whole group (tp fastest: ``kiln.models.pipeline``)."""
        return global_rank(self.tp.rank, self.tp.size, self.stage.rank)

    @property
    def world_size(self) -> int:
        return self.tp.size * self.stage.size


class RankWorker:
    """One rank: its model runner shard and its mirror of the live requests."""

    def __init__(self, spec: WorkerSpec):
        self.rank = spec.rank
        self.runner = _start(spec)
        self.mirror = RequestMirror()

    def ready_info(self) -> dict[str, Any]:
        runner = self.runner
        info: dict[str, Any] = {"num_blocks": runner.num_blocks}
        if self.rank == 0:
            info.update(max_model_len=runner.max_model_len, tokenizer=runner.tokenizer, arch=runner.arch)
        return info

    def execute(self, delta: StepDelta) -> Optional[RunnerOutput]:
        out = self.runner.execute(self.mirror.apply(delta))
        return out if self.runner.is_sampler else None

    def lora(self, method: str, arg: Any) -> tuple[str, Any]:
        """("ok", the manager's answer) to add_lora / remove_lora, or ("refused", the ValueError of
        an adapter this rank cannot serve): a refusal keeps the rank serving."""
        manager = self.runner.lora
        if manager is None:
            return "refused", ValueError("this engine serves no LoRA adapters; start it with lora.enabled=true")
        try:
            return "ok", manager.add(arg) if method == "add_lora" else manager.remove(arg)
        except ValueError as exc:
            return "refused", exc

    def forget(self, request_ids: list[str]) -> None:
        self.mirror.forget(request_ids)
        for request_id in request_ids:
            self.runner.forget(request_id)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a spawned rank process."""
    parent_pid = os.getppid()
    try:
        worker = RankWorker(spec)
        conn.send(("ready", worker.ready_info()))
    except BaseException as exc:  # noqa: BLE001  (reported to the engine, which raises it)
        _report(conn, exc)
        return
    try:
        _serve(worker, conn, parent_pid)
    finally:
        _stop_group()
    # Interpreter teardown with torch loaded takes seconds and has nothing left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start(spec: WorkerSpec):
    import torch.distributed as dist

    from kiln.models.loader import resolve_device
    from kiln.ops.options import set_kernel_options
    from kiln.runtime.model_runner import ModelRunner
    from kiln.runtime.pipeline import init_stage_groups

    set_kernel_options(spec.kernels)
    _thread_lock_for_progress_bars()
    device = resolve_device(spec.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(spec.rank if spec.local_gpu is None else spec.local_gpu)
    else:
        # Ranks share the host's cores; each taking all of them only adds contention.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=spec.init_method,
                            rank=spec.rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
    init_stage_groups(spec.tp, spec.stage)
    if device.type == "cuda" and spec.all_reduce == "symm_mem" and spec.tp.size > 1:
        from kiln.models.loader import resolve_dtype
        from kiln.ops import symm_mem_all_reduce

        local_gpu = torch.device("cuda", torch.cuda.current_device())
        symm_mem_all_reduce.setup(resolve_dtype(spec.model.dtype, device), local_gpu)
    return ModelRunner(spec.model, spec.cache, spec.compile, spec.scheduler, spec.tp, stage=spec.stage,
                       lora=spec.lora)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (``""``: on every interface): a group's rendezvous, a server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _serve(worker: RankWorker, conn: Connection, parent_pid: int) -> None:
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
                conn.send(("ok", worker.execute(arg)))
            elif method == "forget":
                worker.forget(arg)
            elif method in ("add_lora", "remove_lora"):
                conn.send(worker.lora(method, arg))
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


def _thread_lock_for_progress_bars() -> None:
    """tqdm (FX's interpreter makes a disabled bar while kiln compiles) otherwise creates a
    multiprocessing lock, a named semaphore that ``os._exit`` never unlinks and the resource
    tracker then reports as leaked. A rank's bars are never shared between processes."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _stop_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (a peer already gone must not turn exit into a hang)
            pass
