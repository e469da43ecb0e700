"""RayExecutor: tensor and pipeline parallelism over Ray actors, one per rank, on one host or across several.

    engine process (Ray driver)                           Ray actors: one per rank, one bundle each
    Scheduler ─ StepEncoder ─ StepDelta ─ ray.put once ─┬─> rank 0: RankWorker: mirror ─ shard ─ sample ─┐
                                                        └─> rank 1: RankWorker: mirror ─ shard ──────────┤
    Engine <──────────── RunnerOutput (rank 0's answer) <── all-reduce between ranks (gloo / NCCL) ──────┘
                                       the group meets at tcp://<rank 0's node IP>:<a port free there>

The same rank state as ``mp`` (``kiln.runtime.worker.RankWorker``: runner shard + request mirror),
driven by actor method calls instead of a pipe loop. The scheduler runs once, in the engine; a step
is encoded once (``kiln.runtime.step_delta``), put in the object store once, and every actor
executes it; rank 0's answer is the step's result (under pipeline parallelism, that of tp rank 0
of the last stage; ranks laid out as ``mp``'s, ``kiln.models.pipeline``). Each actor holds one bundle ({"GPU": 1} on CUDA,
where Ray sets CUDA_VISIBLE_DEVICES so the rank's GPU is cuda:0; {"CPU": 1} on the CPU), placed by
``parallel.placement_strategy`` (PACK: fill a node first). ``submit`` makes the calls and returns
their ObjectRefs, ``wait`` gets them, so the ranks compute step k+1 while the engine turns step k
into outputs; an actor runs its calls in order, so a ``forget`` made meanwhile applies after the step.

Cluster: the one this process already joined, else the one ``RAY_ADDRESS`` names or one running on
this host (``ray.init(address="auto")``), else a local one (also with ``RAY_ADDRESS=local``) that
kiln starts and stops again with the last executor on it. A cluster kiln did not start is never
shut down.

Rules kept here (beside ``base``'s fail-fast rules, which this executor follows):
- Every wait is a ``ray.wait`` with a deadline. An actor that dies arrives as a RayActorError, a
  rank's exception as a RayTaskError whose cause is the exception itself. A ``forget`` is not
  awaited, but the next gather checks it, so a failed forget still fails the engine.
- Placement never waits forever: ``PLACEMENT_TIMEOUT_S`` at most, not at all on a local cluster
  kiln started that is too small.
- No orphans: ``shutdown`` (also run at exit, and idempotent) kills every actor, waits a moment for
  the local ones' processes to go, and removes the placement group.
- Ray stays optional: it is imported only when this backend is chosen, and without it
  ``make_ray_executor`` says how to install it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
from typing import Any, Optional

from kiln.config import CacheConfig, CompileConfig, KernelConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kiln.models.pipeline import driver_rank
from kiln.runtime.executor.base import START_TIMEOUT_S, Executor, RankFailures, collective_timeout_s, rank_layout
from kiln.runtime.model_runner import RunnerOutput
from kiln.runtime.scheduler_output import SchedulerOutput
from kiln.runtime.step_delta import StepDelta, StepEncoder
from kiln.runtime.worker import RankWorker, WorkerSpec, free_port

PLACEMENT_TIMEOUT_S = 120.0  # how long the cluster may take to find room for every rank
_EXIT_WAIT_S = 5.0
# Environment the ranks need from the engine's (the cache dir, NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_*,
# Inductor and Triton switches); never CUDA_VISIBLE_DEVICES, which Ray sets per actor.
_FORWARDED_ENV = ("KILN_", "NCCL_", "GLOO_", "TORCH", "TRITON_", "HF_")


def make_ray_executor(model: ModelConfig, cache: CacheConfig, compile: CompileConfig, parallel: ParallelConfig,
                      scheduler: Optional[SchedulerConfig] = None,
                      kernels: KernelConfig = KernelConfig()) -> RayExecutor:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("parallel.backend=ray needs the package 'ray', which is not installed (pip install "
                         "'kiln[ray]', or pip install ray); on one host use parallel.backend=mp") from None
    return RayExecutor(model, cache, compile, parallel, scheduler, kernels=kernels)


class RankActor:
    """The body of one rank's actor (``ray.remote`` wraps it at start-up, so importing needs no Ray)."""

    def __init__(self) -> None:
        self.worker: Optional[RankWorker] = None

    def whereabouts(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def rendezvous_port(self) -> int:
        return free_port("")  # free on every interface: ranks on other nodes connect to it

    def start(self, spec: WorkerSpec) -> dict[str, Any]:
        self.worker = RankWorker(spec)
        return self.worker.ready_info()

    def execute(self, delta: StepDelta) -> Optional[RunnerOutput]:
        return self.worker.execute(delta)

    def forget(self, request_ids: list[str]) -> None:
        self.worker.forget(request_ids)


class RayExecutor(Executor):
    """One ``ModelRunner`` shard per rank, each in a Ray actor of one placement group."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, compile: CompileConfig, parallel: ParallelConfig,
                 scheduler: Optional[SchedulerConfig] = None, start_timeout_s: float = START_TIMEOUT_S,
                 kernels: KernelConfig = KernelConfig()):
        import ray

        self.world_size = parallel.world_size
        self._driver = driver_rank(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)  # answers
        self.step_timeout_s = parallel.step_timeout_s
        self._failures = RankFailures("Ray", stop=self.shutdown)
        self._encoder = StepEncoder()
        self._in_flight: Optional[list[Any]] = None  # ObjectRefs of the step submitted, not yet waited for
        self.actors: list[Any] = []
        self.whereabouts: list[tuple[str, int]] = []  # (node IP, pid) per rank
        self._forgets: list[tuple[int, Any]] = []  # (rank, ObjectRef) not yet checked for errors
        self._placement = None
        self._cluster = _ClusterLease(self.world_size)
        atexit.register(self.shutdown)
        use_gpu = _wants_gpu(model.device, ray.cluster_resources())
        self._start_actors(use_gpu, parallel.placement_strategy)
        self.whereabouts = self._gather([a.whereabouts.remote() for a in self.actors], start_timeout_s)
        port = self._gather([self.actors[0].rendezvous_port.remote()], start_timeout_s)[0]
        init_method = f"tcp://{_url_host(self.whereabouts[0][0])}:{port}"
        model = dataclasses.replace(model, device="cuda" if use_gpu else "cpu")  # as the bundles were chosen
        specs = [WorkerSpec(model, cache, compile, scheduler, tp, init_method,
                            collective_timeout_s=collective_timeout_s(self.step_timeout_s, start_timeout_s),
                            all_reduce=parallel.all_reduce, local_gpu=0 if use_gpu else None, stage=stage,
                            kernels=kernels)
                 for tp, stage in rank_layout(parallel)]
        self._describe_ranks(self._gather([a.start.remote(s) for a, s in zip(self.actors, specs)], start_timeout_s))

    def _start_actors(self, use_gpu: bool, strategy: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"GPU": 1} if use_gpu else {"CPU": 1}
        (kind,) = bundle
        total, free = ray.cluster_resources().get(kind, 0), ray.available_resources().get(kind, 0)
        no_room = (f"the Ray cluster has no room for {self.world_size} bundles of {bundle} ({strategy}): "
                   f"{free:g} of its {total:g} {kind}s are free")
        if self._cluster.on_started and total < self.world_size:
            self._failures.fail(no_room)  # a local cluster kiln started does not grow: do not wait
        self._placement = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=strategy)
        ready, _ = ray.wait([self._placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:  # an autoscaling cluster may add nodes meanwhile
            self._failures.fail(f"{no_room} (waited {PLACEMENT_TIMEOUT_S:.0f} s)")
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}
        actor_class = ray.remote(RankActor)
        for rank in range(self.world_size):
            in_bundle = PlacementGroupSchedulingStrategy(self._placement, placement_group_bundle_index=rank)
            self.actors.append(actor_class.options(num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0,
                                                   scheduling_strategy=in_bundle,
                                                   runtime_env={"env_vars": env}).remote())

    def submit(self, sched: SchedulerOutput) -> list[Any]:
        """Call every actor and return its ObjectRefs at once: the ranks run while the engine works."""
        import ray

        self._failures.check_usable()
        self._check_idle(self._in_flight is not None)
        delta = ray.put(self._encoder.encode(sched))  # once, however many ranks
        self._in_flight = [actor.execute.remote(delta) for actor in self.actors]
        return self._in_flight

    def wait(self, handle: list[Any]) -> RunnerOutput:
        if handle is not self._in_flight:
            raise RuntimeError("wait() got a step that is not the one in flight")
        self._in_flight = None
        return self._gather(handle, self.step_timeout_s)[self._driver]

    def forget(self, request_ids: list[str]) -> None:
        if request_ids:
            self._failures.check_usable()
            self._encoder.forget(request_ids)
            # No answer awaited now: an actor runs its calls in order, and the next gather checks these.
            self._forgets += [(rank, a.forget.remote(request_ids)) for rank, a in enumerate(self.actors)]

    def shutdown(self) -> None:
        """Kill every actor, remove the placement group, release the cluster. Safe to call more than once."""
        atexit.unregister(self.shutdown)
        actors, self.actors, self._forgets = self.actors, [], []
        placement, self._placement = self._placement, None
        if actors or placement is not None:
            _kill(actors, placement, self.whereabouts)
        self._cluster.release()

    # ---- answers --------------------------------------------------------------------------------
    def _gather(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """One answer per rank (``refs[rank]``), in rank order; raises as soon as any rank dies, errs
        or times out. Pending forgets are checked along the way."""
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        rank_of.update({ref: rank for rank, ref in self._forgets})
        self._forgets = []
        answers: dict[Any, Any] = {}
        pending = list(rank_of)
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._failures.no_answer(sorted({rank_of[ref] for ref in pending}), timeout_s)
            for ref in ready:
                answers[ref] = self._get(ref, rank_of[ref])
        return [answers[ref] for ref in refs]

    def _get(self, ref: Any, rank: int) -> Any:
        import ray
        from ray.exceptions import RayActorError, RayError, RayTaskError

        try:
            return ray.get(ref)
        except RayActorError as exc:
            self._failures.fail(f"tensor-parallel rank {rank}{self._where(rank)} died ({_first_line(exc)})", exc)
        except RayTaskError as exc:
            self._failures.fail(f"tensor-parallel rank {rank}{self._where(rank)} failed:\n{exc}", exc.cause)
        except RayError as exc:
            self._failures.fail(f"tensor-parallel rank {rank}{self._where(rank)} is unreachable ({exc!r})", exc)

    def _where(self, rank: int) -> str:
        if rank < len(self.whereabouts):
            ip, pid = self.whereabouts[rank]
            return f" (pid {pid} on {ip})"
        return ""


class _ClusterLease:
    """This executor's hold on a Ray cluster. A local cluster kiln starts is stopped when the last
    executor holding it lets go; a cluster found running (or joined by the user) is left alone."""

    _holders_of_started = 0  # executors on the cluster kiln started in this process, if any

    def __init__(self, min_cpus: int):
        import ray

        if ray.is_initialized():
            self.on_started = _ClusterLease._holders_of_started > 0
        else:
            self.on_started = _join_or_start(min_cpus)
        if self.on_started:
            _ClusterLease._holders_of_started += 1

    def release(self) -> None:
        if not self.on_started:
            return
        self.on_started = False
        _ClusterLease._holders_of_started -= 1
        if _ClusterLease._holders_of_started == 0:
            import ray

            ray.shutdown()


def _join_or_start(min_cpus: int) -> bool:
    """Connect to the cluster RAY_ADDRESS names or one running on this host, else start a local one
    (at once for RAY_ADDRESS=local). Returns whether it started one."""
    import ray

    quiet = dict(include_dashboard=False, logging_level=logging.WARNING)
    address = os.environ.get("RAY_ADDRESS") or "auto"
    if address != "local":
        try:
            ray.init(address="auto", **quiet)
            return False
        except ConnectionError:
            if address != "auto":
                raise  # the cluster named is unreachable: starting another would hide that
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, min_cpus), **quiet)
    return True


def _wants_gpu(device: str, cluster_resources: dict[str, float]) -> bool:
    # Decided by the cluster, not by this process: the engine may run on a node without a GPU.
    if device == "auto":
        return cluster_resources.get("GPU", 0) > 0
    return device == "cuda"


def _kill(actors: list[Any], placement: Any, whereabouts: list[tuple[str, int]]) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    if not ray.is_initialized():
        return  # Ray's own exit handler already stopped everything
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001  (an actor already gone)
            pass
    if placement is not None:
        try:
            remove_placement_group(placement)
        except Exception:  # noqa: BLE001
            pass
    # Ray kills asynchronously; wait a moment for the processes on this node, so the next engine
    # finds their memory (and GPU) free.
    here = ray.util.get_node_ip_address()
    local_pids = [pid for ip, pid in whereabouts[:len(actors)] if ip == here]
    deadline = time.monotonic() + _EXIT_WAIT_S
    while local_pids and time.monotonic() < deadline:
        local_pids = [pid for pid in local_pids if _alive(pid)]
        if local_pids:
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:  # no /proc here: trust os.kill
        return True


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
