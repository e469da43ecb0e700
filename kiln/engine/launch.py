"""Starting an engine-core process, importing nothing heavy: ``kiln serve`` spawns it first thing.

    core = EngineCoreProcess(config)        # spawned now; its torch import and model load begin
    ...                                     # meanwhile this process imports the server
    client = EngineCoreClient(config, started=core)

The child imports torch, builds the engine and connects to the sockets its frontends bind (ZeroMQ
retries until they exist), so the frontend's imports and the engine core's start-up run side by
side. ``EngineCoreProcess`` serves one frontend or several (``server.api_server_count``: each
attaches through ``address(i)``). This module imports neither torch nor the engine: the spawn's
target imports ``kiln.engine.core`` in the child.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from typing import Optional

from kiln.clock import process_age_s
from kiln.config import EngineConfig

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # as the CLI's (hydra/job_logging=stdout)


def inherited_log_level() -> Optional[int]:
    """The level a spawned child (engine core, frontend) logs at: the caller's, once logging is set up."""
    root = logging.getLogger()
    return root.getEffectiveLevel() if root.handlers else None


def address(ipc_dir: str, index: int) -> tuple[str, str]:
    """Frontend ``index``'s (input, output) endpoints in ``ipc_dir``."""
    return f"ipc://{ipc_dir}/in{index}", f"ipc://{ipc_dir}/out{index}"


@dataclasses.dataclass(frozen=True)
class ReplicaPlacement:
    """Replica ``index`` of ``count`` data-parallel engine cores (``parallel.data_parallel_size``)."""

    index: int
    count: int

    def visible_devices(self, visible: Optional[str]) -> str:
        """The replica's CUDA_VISIBLE_DEVICES: the index-th of the parent's (``visible``), so its GPU
        is cuda:0. Set at spawn, before the child's torch can read it."""
        devices = visible.split(",") if visible else [str(i) for i in range(self.count)]
        return devices[self.index % len(devices)]

    def apply(self) -> None:
        """Take this replica's share of the CPU cores: replicas on one host would otherwise each
        start a thread per core and contend."""
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.count))


def _run_engine_core(config: EngineConfig, addresses: list[tuple[str, str]], log_level: Optional[int],
                     placement: Optional[ReplicaPlacement]) -> None:
    """The spawned process's target: signals go to the frontends (which stop it), then the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if placement is not None:
        placement.apply()
    if log_level is not None:
        logging.basicConfig(level=log_level, format=LOG_FORMAT)
    from kiln.engine.core import run_engine_core  # torch and the runtime load here, in the child

    run_engine_core(config, addresses)


_SPAWN_ENV_LOCK = threading.Lock()


def _spawn(config: EngineConfig, ipc_dir: str, count: int,
           placement: Optional[ReplicaPlacement] = None) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(
        target=_run_engine_core, name="kiln-engine-core",
        args=(config, [address(ipc_dir, i) for i in range(count)], inherited_log_level(), placement))
    if placement is None:
        proc.start()
        return proc
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    with _SPAWN_ENV_LOCK:  # the child inherits the environment as it is when it starts
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.visible_devices(previous)
        try:
            proc.start()
        finally:
            if previous is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = previous
    return proc


@dataclasses.dataclass(frozen=True)
class EngineCoreAddress:
    """What a frontend process needs to attach to a shared engine core (picklable)."""

    ipc_dir: str
    index: int
    engine_pid: int
    owner_pid: int  # the process that started the engine core: the start-up clock is its
    age_at_spawn: float


class EngineCoreProcess:
    """One engine-core process for ``count`` frontends, spawned at construction. With one frontend,
    an ``EngineCoreClient(config, started=this)`` owns it (and its shutdown stops it); with several,
    each attaches through ``address(i)`` and the starter calls ``stop``."""

    def __init__(self, config: EngineConfig, count: int = 1, placement: Optional[ReplicaPlacement] = None):
        self.count = count
        self.ipc_dir = tempfile.mkdtemp(prefix="kiln-engine-")
        self.age_at_spawn = process_age_s()  # where the engine core's own start-up clock begins
        self.process = _spawn(config, self.ipc_dir, count, placement)

    @classmethod
    def for_server(cls, config: EngineConfig) -> Optional["EngineCoreProcess"]:
        """The engine core ``kiln serve`` starts for ``config``: one process with a socket pair per
        frontend, or None where the server starts its own (data-parallel replicas, each placed)."""
        if config.parallel.data_parallel_size > 1:
            return None
        return cls(config, config.server.api_server_count)

    def address(self, index: int) -> EngineCoreAddress:
        return EngineCoreAddress(self.ipc_dir, index, self.process.pid, os.getpid(), self.age_at_spawn)

    def stop(self, timeout: float = 30.0) -> None:
        """Wait for the engine core to leave (its frontends have detached), else kill it."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

