"""MultiprocExecutor: tensor and pipeline parallelism over ``tensor_parallel_size x
pipeline_parallel_size`` processes on this host.

    engine process                                  rank processes (torch.multiprocessing, spawn)
    Scheduler ─ SchedulerOutput ─ StepEncoder ─ StepDelta, pickled once ─┬─> rank 0: mirror ─ ModelRunner shard ─ sample ─┐
                                                                         └─> rank 1: mirror ─ ModelRunner shard ──────────┤
    Engine <──────────────────────── RunnerOutput (rank 0) <── all-reduce between ranks (gloo / NCCL) ────────────────────┘

The scheduler runs once, in the engine; every rank runs the same forward on its shard; rank 0
samples. Under pipeline parallelism every rank gets the step too, the stages hand their hidden
states on in turn (``kiln.runtime.pipeline``), and tp rank 0 of the last stage samples and answers. All ranks are workers (``kiln.runtime.worker``), so the engine process holds no model and
no process group. A step sends only what changed since the last one (``kiln.runtime.step_delta``).
``submit`` sends a step and returns, ``wait`` gathers the answers: the ranks compute step k+1
while the engine turns step k into outputs; a ``forget`` sent meanwhile queues behind the step on
each pipe, so it applies after it.

Rules kept here (beside ``base``'s fail-fast rules, which this executor follows):
- Every wait selects on the pipes *and* the process sentinels with a deadline, so a rank that
  dies is seen at once, not when the deadline passes; its last words (an error) are read first.
- No orphans: ``shutdown`` (also run at exit) asks, then terminates, then kills every worker; the
  workers themselves exit when the engine's pipe closes or its process disappears.
"""

from __future__ import annotations

import atexit
import pickle
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Optional

import torch.multiprocessing as mp

from kiln.config import (CacheConfig, CompileConfig, KernelConfig, LoraConfig, ModelConfig, ParallelConfig,
                         SchedulerConfig)
from kiln.lora_request import LoRARequest
from kiln.models.loader import resolve_device
from kiln.models.pipeline import driver_rank
from kiln.runtime.executor.base import (START_TIMEOUT_S, Executor, RankFailures, check_ranks_fit,
                                        collective_timeout_s, rank_layout)
from kiln.runtime.model_runner import RunnerOutput
from kiln.runtime.scheduler_output import SchedulerOutput
from kiln.runtime.step_delta import StepEncoder
from kiln.runtime.worker import WorkerSpec, free_port, worker_main

_JOIN_TIMEOUT_S = 5.0


class MultiprocExecutor(Executor):
    """One ``ModelRunner`` shard per rank, each in its own process."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, compile: CompileConfig, parallel: ParallelConfig,
                 scheduler: Optional[SchedulerConfig] = None, start_timeout_s: float = START_TIMEOUT_S,
                 lora: LoraConfig = LoraConfig(), kernels: KernelConfig = KernelConfig()):
        if resolve_device(model.device).type == "cuda":
            import torch

            check_ranks_fit(parallel, torch.cuda.device_count())
        self.world_size = parallel.world_size
        self._driver = driver_rank(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)  # answers
        self.step_timeout_s = parallel.step_timeout_s
        self._failures = RankFailures("multiprocess", stop=lambda: self._stop(grace_s=0.0))
        self._encoder = StepEncoder()
        self._num_steps = 0
        self._in_flight: Optional[int] = None  # the step submitted and not yet waited for
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._conns: list[Connection] = []
        self.procs: list[Any] = []
        group_timeout_s = collective_timeout_s(self.step_timeout_s, start_timeout_s)
        atexit.register(self.shutdown)
        for rank, (tp, stage) in enumerate(rank_layout(parallel)):
            spec = WorkerSpec(model, cache, compile, scheduler, tp, init_method, collective_timeout_s=group_timeout_s,
                              all_reduce=parallel.all_reduce, stage=stage, lora=lora, kernels=kernels)
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(spec, child_conn), name=f"kiln-rank{rank}")
            proc.start()
            child_conn.close()  # the child's end lives in the child: EOF here means it is gone
            self._conns.append(parent_conn)
            self.procs.append(proc)
        self._describe_ranks(self._gather("ready", start_timeout_s))

    def submit(self, sched: SchedulerOutput) -> int:
        """Send the step to every rank and return at once: the ranks run it while the engine works."""
        self._check_idle(self._in_flight is not None)
        self._send(range(self.world_size), ("execute", self._encoder.encode(sched)))
        self._num_steps += 1
        self._in_flight = self._num_steps
        return self._num_steps

    def wait(self, handle: int) -> RunnerOutput:
        if handle != self._in_flight:
            raise RuntimeError(f"step {handle} is not the one in flight ({self._in_flight})")
        self._in_flight = None
        return self._gather("ok", self.step_timeout_s)[self._driver]

    def forget(self, request_ids: list[str]) -> None:
        if request_ids:
            self._encoder.forget(request_ids)
            self._send(range(self.world_size), ("forget", request_ids))

    def add_lora(self, lora: LoRARequest) -> bool:
        """Every rank reads ``lora`` and keeps its shard; the ValueError of an adapter a rank
        refuses is raised here, after every rank has forgotten it."""
        answers = self._lora_call("add_lora", lora)
        refused = next((a for a in answers if isinstance(a, ValueError)), None)
        if refused is not None:
            self._lora_call("remove_lora", lora.lora_int_id)
            raise refused
        return answers[0]

    def remove_lora(self, lora_id: int) -> bool:
        return any(a is True for a in self._lora_call("remove_lora", lora_id))

    def _lora_call(self, method: str, arg: Any) -> list[Any]:
        self._check_idle(self._in_flight is not None)
        self._send(range(self.world_size), (method, arg))
        return self._gather("ok", self.step_timeout_s, refused_ok=True)

    def shutdown(self) -> None:
        """Stop every worker: ask, then terminate, then kill. Safe to call more than once."""
        self._stop(_JOIN_TIMEOUT_S)

    def _stop(self, grace_s: float) -> None:
        atexit.unregister(self.shutdown)
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("shutdown", None)))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(_JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self.procs = [], []

    # ---- pipes ----------------------------------------------------------------------------------
    def _send(self, ranks, message: tuple) -> None:
        self._failures.check_usable()
        data = pickle.dumps(message)  # once, however many ranks
        for rank in ranks:
            try:
                self._conns[rank].send_bytes(data)
            except (OSError, ValueError) as exc:
                proc = self.procs[rank]
                if proc.exitcode is not None or not proc.is_alive():
                    self._failures.fail(self._died(rank))
                self._failures.fail(f"tensor-parallel rank {rank} is unreachable ({exc!r})"
                                    f"{self._exit_codes()}")

    def _gather(self, expected: str, timeout_s: float, refused_ok: bool = False) -> list[Any]:
        """One answer per rank, in rank order; raises as soon as any rank dies, errs or times out.
        ``refused_ok``: a ("refused", ValueError) answer is that rank's answer."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < self.world_size:
            pending = {self._conns[r]: r for r in range(self.world_size) if r not in answers}
            sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
            ready = wait([*pending, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._failures.no_answer(sorted(set(range(self.world_size)) - set(answers)), timeout_s)
            for conn in [c for c in ready if c in pending]:
                answers[pending[conn]] = self._read(conn, pending[conn], expected, refused_ok)
            for sentinel in [s for s in ready if s in sentinels]:
                rank = sentinels[sentinel]
                if rank not in answers and self._conns[rank].poll():
                    self._read(self._conns[rank], rank, expected)  # its last words: an error, raised
                self._failures.fail(self._died(rank))
        return [answers[r] for r in range(self.world_size)]

    def _read(self, conn: Connection, rank: int, expected: str, refused_ok: bool = False) -> Any:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            self._failures.fail(f"tensor-parallel rank {rank} closed its pipe{self._exit_codes()}")
        if refused_ok and message[0] == "refused":
            return message[1]
        if message[0] == "error":
            _, exc, text = message
            self._failures.fail(f"tensor-parallel rank {rank} failed:\n{text}", exc)
        if message[0] != expected:
            self._failures.fail(f"tensor-parallel rank {rank} answered {message[0]!r}, expected {expected!r}")
        return message[1]

    def _died(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(1.0)  # a dying process may not have been reaped yet
        return f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"

    def _exit_codes(self) -> str:
        codes = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode is not None}
        return f" (exit codes {codes})" if codes else ""
