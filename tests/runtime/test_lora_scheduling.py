"""LoRA in the scheduler and the prefix cache, on toy pools of 4-token blocks (no model): at most
``max_loras`` distinct adapters run at once (the head waits, no overtaking), and blocks are keyed by
adapter, so two adapters never share KV while the base model and one adapter each hit their own."""

from __future__ import annotations

from kiln.config import SchedulerConfig
from kiln.lora_request import LoRARequest
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.scheduler import Scheduler
from kiln.sampling_params import SamplingParams

A, B = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")


def _scheduler(max_loras):
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), kv, max_loras=max_loras), kv


def _request(rid, lora, prompt=tuple(range(9))):
    return Request(rid, list(prompt), SamplingParams(max_tokens=2), lora_request=lora)


def test_distinct_adapters_never_exceed_the_slots():
    sched, _ = _scheduler(max_loras=1)
    for rid, lora in (("a1", A), ("base", None), ("b1", B), ("a2", A)):
        sched.add_request(_request(rid, lora))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a1", "base"]  # b1 waits at the head
    assert [r.request_id for r in sched.waiting] == ["b1", "a2"]
    sched.update(out, {"a1": 5, "base": 5})
    out = sched.schedule()
    sched.update(out, {s.request.request_id: 6 for s in out.scheduled if s.samples})  # a1, base finish
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["b1"]  # a2 waits behind b1's adapter
    assert {r.lora_id for r in sched.running} == {2}


def test_blocks_are_keyed_by_adapter():
    _, kv = _scheduler(max_loras=2)
    first = {}
    for rid, lora in (("base", None), ("a", A), ("b", B)):
        req = _request(rid, lora)
        blocks, num_cached = kv.get_computed_blocks(req)
        assert num_cached == 0  # same tokens, another adapter: nothing shared
        first[rid] = kv.allocate_slots(req, req.num_tokens, blocks)
    assert len({ids[0] for ids in first.values()}) == 3
    for rid, lora in (("base2", None), ("a2", A)):
        _, num_cached = kv.get_computed_blocks(_request(rid, lora))
        assert num_cached == 8  # its own adapter's two full blocks
