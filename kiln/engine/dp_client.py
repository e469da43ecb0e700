"""DataParallelClient: ``parallel.data_parallel_size`` engine cores behind one frontend.

    client = DataParallelClient(config)        # spawns one engine-core process per replica
    client.wait_ready()
    stream = await client.add_request("req-1", "Hello", SamplingParams(max_tokens=8))

Each replica is an ``EngineCoreClient`` with its own process, KV cache and prefix cache (replica
i takes GPU i, or its share of the CPU cores); this client has the same interface, so the server
only constructs it.

Rules:
- A request is tokenized once, here, then routed (``Router``): to the replica that last got a
  prompt with the same first KV block (its prefix cache likely holds it) unless that replica is
  much busier than the least loaded, else to the least loaded (fewest unfinished sequences, then
  prompt tokens, as admitted now). A replica at its queue limit passes the request to the next.
- The server's queue limits are split evenly over the replicas.
- A replica that dies fails its own pending requests (EngineDeadError); the others keep serving
  and take every new request. ``degraded()`` names the dead ones (``/health`` answers 503 with
  it); ``is_ready()`` and ``is_healthy()`` stay True while any replica runs, and ``on_dead`` runs
  once none does (the server then exits with status 1, as for its one engine core).
- ``stats()`` sums the live replicas' stats (the hit rate is their mean, a build flag their
  maximum) and lists each replica's under ``replicas`` (the per-replica metrics).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
from typing import Callable, Optional

from kiln.config import EngineConfig
from kiln.engine.core_client import EngineCoreClient
from kiln.engine.launch import ReplicaPlacement
from kiln.engine.streams import EngineDeadError, QueueFullError, QueueLimits, RequestStream
from kiln.lora_request import LoRARequest
from kiln.runtime.input_processor import Prompt, TokenizedPrompt
from kiln.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A prompt goes to the replica that holds its prefix unless that one has more than this many
# unfinished sequences above the least loaded (plus half the least loaded's own, as loads grow).
AFFINITY_SLACK_SEQS = 4
MAX_AFFINITY_KEYS = 65536  # first blocks remembered, least recently sent forgotten first

Load = tuple[int, int]  # (unfinished sequences, their prompt tokens) admitted at a replica


class Router:
    """Chooses a replica per request from the replicas' loads and the prefix each was last sent."""

    def __init__(self, max_keys: int = MAX_AFFINITY_KEYS):
        self._max_keys = max_keys
        self._last: collections.OrderedDict[int, int] = collections.OrderedDict()  # prefix key -> replica

    def order(self, loads: list[Optional[Load]], key: Optional[int]) -> list[int]:
        """The live replicas (a load, not None) from the most preferred: the least loaded first,
        except that the replica ``key`` was last sent to comes first while it is not much busier."""
        live = sorted((i for i, load in enumerate(loads) if load is not None), key=lambda i: loads[i])
        if not live or key is None:
            return live
        home = self._last.get(key)
        if home is not None and home in live:
            least = loads[live[0]][0]
            if loads[home][0] <= least + AFFINITY_SLACK_SEQS + least // 2:
                live.remove(home)
                live.insert(0, home)
        return live

    def sent(self, key: Optional[int], replica: int) -> None:
        if key is None:
            return
        self._last[key] = replica
        self._last.move_to_end(key)
        if len(self._last) > self._max_keys:
            self._last.popitem(last=False)


def prefix_key(token_ids: list[int], block_size: int, lora_request: Optional[LoRARequest] = None) -> Optional[int]:
    """What names a prompt's first full KV block (as the prefix cache would find it), or None for
    a prompt shorter than one block."""
    if len(token_ids) < block_size:
        return None
    return hash((lora_request.lora_int_id if lora_request is not None else 0, tuple(token_ids[:block_size])))


def _split(limits: QueueLimits, count: int) -> QueueLimits:
    def share(limit: Optional[int]) -> Optional[int]:
        return None if limit is None else -(-limit // count)

    return QueueLimits(share(limits.max_queued_seqs), share(limits.max_queued_tokens))


class DataParallelClient:
    def __init__(self, config: EngineConfig, model_name: Optional[str] = None,
                 limits: QueueLimits = QueueLimits(), on_dead: Optional[Callable[[], None]] = None):
        """Start ``config.parallel.data_parallel_size`` engine cores; ``on_dead`` runs once the
        last of them has stopped without being asked to."""
        count = config.parallel.data_parallel_size
        _check_devices(config, count)
        self.model_name = model_name or config.model.model
        self.limits = limits
        self._on_dead = on_dead
        self._block_size = config.cache.block_size
        self._router = Router()
        self._route_lock = threading.Lock()
        self._num_routed = [0] * count
        replica = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1))
        self.replicas: list[EngineCoreClient] = []
        try:
            for i in range(count):
                self.replicas.append(EngineCoreClient(
                    replica, self.model_name, _split(limits, count), on_dead=lambda i=i: self._replica_died(i),
                    placement=ReplicaPlacement(i, count)))
        except BaseException:
            self.shutdown(timeout=5)
            raise

    # ---- state ----------------------------------------------------------------------------------
    def _first(self) -> EngineCoreClient:
        """A live replica (any: they share the tokenizer and limits), else the first."""
        return next((c for c in self.replicas if c.is_healthy()), self.replicas[0])

    @property
    def tokenizer(self):
        return self._first().tokenizer

    @property
    def max_model_len(self) -> Optional[int]:
        return self._first().max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._first().eos_token_ids

    @property
    def grammars(self):
        return self._first().grammars

    @property
    def startup(self):
        return self.replicas[0].startup

    @property
    def pids(self) -> list[Optional[int]]:
        """The replicas' engine-core process ids, in replica order."""
        return [c.pid for c in self.replicas]

    def is_ready(self) -> bool:
        """Some replica is built and running: requests are taken (``wait_ready`` waits for all)."""
        return any(c.is_ready() for c in self.replicas)

    def is_healthy(self) -> bool:
        """Some replica still runs (or loads): requests are still taken."""
        return any(c.is_healthy() for c in self.replicas)

    def degraded(self) -> Optional[str]:
        """What is wrong while some replica has stopped, naming it; None while all run."""
        dead = [i for i, c in enumerate(self.replicas) if not c.is_healthy()]
        if not dead:
            return None
        count = len(self.replicas)
        names = "; ".join(f"replica {i} (pid {self.replicas[i].pid}): {self.replicas[i].error!r}" for i in dead)
        left = "the others keep serving" if len(dead) < count else "none is left"
        return f"{len(dead)} of {count} data-parallel replicas are not running ({names}); {left}"

    @property
    def error(self) -> Optional[BaseException]:
        problem = self.degraded()
        return RuntimeError(problem) if problem is not None else None

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Block until every replica is built (their loads overlap); raise what the first failure raised."""
        for c in self.replicas:
            c.wait_ready(timeout)

    def stats(self) -> dict:
        per_replica = [c.stats() for c in self.replicas]
        merged = _merge([s for s, c in zip(per_replica, self.replicas) if c.is_healthy()])
        merged["replicas"] = [{**s, "healthy": int(c.is_healthy()), "num_routed": routed}
                              for s, c, routed in zip(per_replica, self.replicas, self._num_routed)]
        return merged

    # ---- requests -------------------------------------------------------------------------------
    def process(self, prompt: Prompt, params: SamplingParams, add_special_tokens: bool = True) -> TokenizedPrompt:
        return self._first().process(prompt, params, add_special_tokens)

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
                          add_special_tokens: bool = True, pooling: Optional[str] = None,
                          lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """As ``EngineCoreClient.add_request``, on the replica ``Router`` picks."""
        processed = self.process(prompt, params, add_special_tokens)
        if any(c.holds(request_id) for c in self.replicas):
            raise ValueError(f"request id {request_id!r} is already in use")
        key = prefix_key(processed.token_ids, self._block_size, lora_request)
        with self._route_lock:
            order = self._router.order(self._loads(), key)
            if not order:
                raise EngineDeadError(self.degraded() or "no data-parallel replica is ready")
            self._router.sent(key, order[0])
        for rank, i in enumerate(order):
            try:
                stream = await self.replicas[i].add_request(request_id, processed, params, priority,
                                                            add_special_tokens, pooling, lora_request)
            except (QueueFullError, EngineDeadError):
                if rank == len(order) - 1:
                    raise
                continue
            self._num_routed[i] += 1
            return stream
        raise AssertionError("unreachable")

    def _loads(self) -> list[Optional[Load]]:
        loads: list[Optional[Load]] = []
        for c in self.replicas:
            if not c.is_ready():
                loads.append(None)
                continue
            s = c.stats()
            loads.append((s["num_queued_seqs"], s["num_queued_tokens"]))
        return loads

    def abort(self, request_id: str) -> None:
        """Safe from any thread; only the replica holding the request has anything to do."""
        for c in self.replicas:
            c.abort(request_id)

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter on every live replica (a request may go to any)."""
        await _all([c.add_lora(lora) for c in self.replicas if c.is_healthy()])

    async def remove_lora(self, lora_int_id: int) -> None:
        await _all([c.remove_lora(lora_int_id) for c in self.replicas if c.is_healthy()])

    def shutdown(self, timeout: Optional[float] = 30.0) -> None:
        """Stop every replica (in parallel: each waits for its process); safe more than once."""
        threads = [threading.Thread(target=c.shutdown, args=(timeout,), daemon=True) for c in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _replica_died(self, index: int) -> None:  # a replica's reader thread
        c = self.replicas[index]
        logger.error("data-parallel replica %d (pid %s) stopped: %s", index, c.pid, c.error)
        if not self.is_healthy() and self._on_dead is not None:
            self._on_dead()


async def _all(calls: list) -> None:
    """Await every call; raise the first failure once all have ended."""
    for result in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(result, BaseException):
            raise result


def _merge(stats: list[dict]) -> dict:
    """One engine's worth of stats from several: counts summed, per-position lists summed by
    position, the prefix-cache hit rate averaged, flags (``compile_building``) at their maximum."""
    merged: dict = {}
    for s in stats:
        for key, value in s.items():
            if key == "compile_building":
                merged[key] = max(merged.get(key, 0), value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
            elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                old = merged.get(key, [])
                merged[key] = [(old[j] if j < len(old) else 0) + (value[j] if j < len(value) else 0)
                               for j in range(max(len(old), len(value)))]
            else:
                merged.setdefault(key, value)
    rates = [s["prefix_cache_hit_rate"] for s in stats if "prefix_cache_hit_rate" in s]
    if rates:
        merged["prefix_cache_hit_rate"] = sum(rates) / len(rates)
    return merged


def _check_devices(config: EngineConfig, count: int) -> None:
    """More replicas than GPUs is an error at once, not replicas sharing a GPU's memory."""
    if config.model.device == "cpu":
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < count:
        raise ValueError(f"parallel.data_parallel_size={count} needs {count} GPUs, one per replica; this machine "
                         f"has {torch.cuda.device_count()}: lower parallel.data_parallel_size")
