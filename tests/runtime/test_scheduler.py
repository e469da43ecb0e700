"""Scheduler driven with fake sampled tokens (no model) on toy KV pools of 4-token blocks."""

import itertools

import pytest

from kiln.config import SchedulerConfig
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.scheduler import Scheduler, _Step
from kiln.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, caching=True, **config):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=caching)
    config = {"max_num_seqs": 128, "max_num_batched_tokens": 2048, **config}
    return Scheduler(SchedulerConfig(**config), kv), kv


_fresh_token_ids = itertools.count(1000)


def make_request(request_id, prompt, max_tokens=4, arrival_time=0.0, **kwargs):
    """prompt: a token list, or a length (distinct tokens per request so nothing is shared)."""
    if isinstance(prompt, int):
        prompt = [next(_fresh_token_ids) for _ in range(prompt)]
    params = SamplingParams(max_tokens=max_tokens, **kwargs.pop("params", {}))
    return Request(request_id, list(prompt), params, arrival_time=arrival_time, **kwargs)


def fake_token(request):
    return 100 + len(request.output_token_ids)  # 100, 101, 102, ... per request


def step(scheduler, token_for=fake_token):
    """One engine step; returns [(request_id, num_new_tokens)] in execution order and the output."""
    output = scheduler.schedule()
    sampled = {s.request.request_id: token_for(s.request) for s in output.scheduled if s.samples}
    plan = [(s.request.request_id, s.num_new_tokens) for s in output.scheduled]
    scheduler.update(output, sampled)
    return plan, output


def drain(scheduler, token_for=fake_token, max_num_steps=200):
    plans = []
    while scheduler.has_unfinished_requests():
        assert len(plans) < max_num_steps, "scheduler made no progress"
        plans.append(step(scheduler, token_for)[0])
    return plans


def test_chunked_prefill_shares_the_budget_with_a_running_decode():
    scheduler, kv = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 3, max_tokens=10)
    scheduler.add_request(a)
    assert step(scheduler)[0] == [("a", 3)]
    scheduler.add_request(make_request("b", 20, max_tokens=2))
    plans = [step(scheduler)[0] for _ in range(4)]
    assert plans == [
        [("a", 1), ("b", 7)],
        [("a", 1), ("b", 7)],
        [("a", 1), ("b", 6)],  # b's last chunk samples its first token
        [("a", 1), ("b", 1)],  # b decodes and finishes
    ]
    assert scheduler.get_request("b") is None
    drain(scheduler)
    assert len(a.output_token_ids) == 10 and a.status is RequestStatus.FINISHED_LENGTH
    assert kv.num_free_blocks == 63


def test_without_chunking_a_prompt_runs_whole_and_nothing_overtakes_the_head():
    scheduler, _ = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    for request_id, num_prompt_tokens in (("a", 6), ("b", 5), ("c", 2)):
        scheduler.add_request(make_request(request_id, num_prompt_tokens))
    assert step(scheduler)[0] == [("a", 6)]  # c would fit the 2 tokens left, but b is ahead of it
    assert step(scheduler)[0] == [("a", 1), ("b", 5), ("c", 2)]


def test_requests_that_could_never_run_are_rejected():
    scheduler, _ = make_scheduler(num_blocks=8, max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="raise max_num_batched_tokens or enable chunked prefill"):
        scheduler.add_request(make_request("long", 9))
    chunked, _ = make_scheduler(num_blocks=8)  # 7 blocks of 4 tokens
    with pytest.raises(ValueError, match="needs 8 KV blocks"):
        chunked.add_request(make_request("huge", 29))
    chunked.add_request(make_request("fits", 28))
    with pytest.raises(ValueError, match="already in use"):
        chunked.add_request(make_request("fits", 3))
    with pytest.raises(ValueError, match="empty"):
        chunked.add_request(make_request("empty", []))
    with pytest.raises(ValueError, match="max_model_len"):
        chunked.add_request(make_request("model", 9, max_model_len=8))
    assert chunked.num_waiting == 1


def test_max_num_seqs_caps_the_running_list():
    scheduler, kv = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 3, max_tokens=2))
    assert step(scheduler)[0] == [("a", 3), ("b", 3)]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    assert step(scheduler)[0] == [("a", 1), ("b", 1)]  # both finish here
    assert step(scheduler)[0] == [("c", 3)]
    drain(scheduler)
    assert kv.num_free_blocks == 63


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("fcfs", ["low", "high2", "high"]),  # the order they reached the scheduler
        ("priority", ["high", "high2", "low"]),  # lower priority value first, then earlier arrival
    ],
)
def test_admission_order_follows_the_policy(policy, expected):
    scheduler, _ = make_scheduler(max_num_seqs=1, policy=policy)
    scheduler.add_request(make_request("low", 3, max_tokens=1, priority=1, arrival_time=0.0))
    scheduler.add_request(make_request("high2", 3, max_tokens=1, priority=0, arrival_time=2.0))
    scheduler.add_request(make_request("high", 3, max_tokens=1, priority=0, arrival_time=1.0))
    assert [plan[0][0] for plan in drain(scheduler)] == expected


def test_out_of_blocks_the_tail_is_preempted_and_resumes_where_it_left_off():
    scheduler, kv = make_scheduler(num_blocks=8)  # blocks 1..7
    a = make_request("a", 12, max_tokens=10)
    b = make_request("b", 12, max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert step(scheduler)[0] == [("a", 12), ("b", 12)]
    assert (kv.get_block_ids("a"), kv.get_block_ids("b")) == ([1, 2, 3], [4, 5, 6])

    plan, output = step(scheduler)  # a needs a 4th block: only 7 is free, so b (the tail) goes
    assert plan == [("a", 1)] and output.preempted_ids == ["b"]
    assert kv.get_block_ids("a") == [1, 2, 3, 7]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert scheduler.num_preemptions == 1
    assert scheduler.waiting == [b] and b.output_token_ids == [100]
    assert kv.block_pool.free_block_ids() == [6, 5, 4]  # b's tail first in line for eviction

    plans = [step(scheduler)[0] for _ in range(8)]  # b cannot come back while a grows into 6 and 5
    assert all(plan == [("a", 1)] for plan in plans)
    assert a.status is RequestStatus.FINISHED_LENGTH and kv.get_block_ids("a") == []
    # b's first block survived eviction: 4 of its 13 tokens are a prefix hit, 9 are recomputed.
    assert step(scheduler)[0] == [("b", 9)]
    assert kv.get_block_ids("b") == [4, 5, 6, 7]
    drain(scheduler)
    assert b.output_token_ids == list(range(100, 110))
    assert b.num_cached_tokens == 0  # counted at its first admission only
    assert kv.num_free_blocks == 7


def test_priority_preempts_the_lowest_priority_even_if_already_scheduled():
    scheduler, kv = make_scheduler(num_blocks=5, policy="priority")  # blocks 1..4
    low = make_request("low", 6, max_tokens=4, priority=1, arrival_time=0.0)
    high = make_request("high", 8, max_tokens=3, priority=0, arrival_time=1.0)
    scheduler.add_request(low)
    assert step(scheduler)[0] == [("low", 6)]
    scheduler.add_request(high)
    assert step(scheduler)[0] == [("low", 1), ("high", 8)]
    # low is scheduled first (admission order), then high needs a 3rd block and none is free:
    # low is the victim, so it leaves this step's output and its blocks go to high.
    plan, output = step(scheduler)
    assert plan == [("high", 1)] and output.preempted_ids == ["low"]
    assert output.num_batched_tokens == 1
    assert kv.get_block_ids("high") == [3, 4, 2]
    assert low.output_token_ids == [100, 101]  # the dropped step sampled nothing for low
    drain(scheduler)
    assert len(low.output_token_ids) == 4 and len(high.output_token_ids) == 3
    assert kv.num_free_blocks == 4


def test_preempting_a_scheduled_request_gives_back_its_budget():
    request = make_request("r", 6)
    built = _Step(token_budget=8)
    built.add(request, 6, [1, 2])
    built.preempt(request)
    assert built.token_budget == 8 and built.to_output().is_empty
    assert built.to_output().preempted_ids == ["r"]


def test_decodes_come_first_and_prefix_hits_are_recorded():
    scheduler, kv = make_scheduler()
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    scheduler.add_request(make_request("first", prompt, max_tokens=1))
    drain(scheduler)
    scheduler.add_request(make_request("other", 6))
    again = make_request("again", prompt, max_tokens=1)
    scheduler.add_request(again)
    plan, output = step(scheduler)
    assert plan == [("again", 1), ("other", 6)]  # two cached blocks leave again one token: a decode
    assert again.num_cached_tokens == 8
    assert (kv.num_queries_tokens, kv.num_hit_tokens) == (9 + 6 + 9, 8)
    assert kv.hit_rate == pytest.approx(8 / 24)


@pytest.mark.parametrize(
    "kwargs, tokens, status, stop_reason, num_output_tokens",
    [
        (dict(eos_token_ids=(7,)), [5, 7, 9], RequestStatus.FINISHED_STOPPED, None, 2),
        (dict(eos_token_ids=(7,), params=dict(ignore_eos=True)), [5, 7, 9], RequestStatus.FINISHED_LENGTH, None, 3),
        (dict(params=dict(stop_token_ids=[9, 42])), [5, 42, 9], RequestStatus.FINISHED_STOPPED, 42, 2),
        (dict(), [5, 6, 7, 8], RequestStatus.FINISHED_LENGTH, None, 3),
        (dict(max_tokens=None, max_model_len=5), [5, 6, 7, 8], RequestStatus.FINISHED_LENGTH, None, 2),
    ],
)
def test_stop_conditions(kwargs, tokens, status, stop_reason, num_output_tokens):
    scheduler, kv = make_scheduler()
    request = make_request("r", 3, **{"max_tokens": 3, **kwargs})
    scheduler.add_request(request)
    drain(scheduler, token_for=lambda r: tokens[len(r.output_token_ids)])
    assert request.status is status and request.stop_reason == stop_reason
    assert len(request.output_token_ids) == num_output_tokens
    assert kv.num_free_blocks == 63


def test_update_returns_requests_that_got_a_token_finished_ones_included():
    scheduler, _ = make_scheduler(max_num_batched_tokens=4)
    short = make_request("short", 2, max_tokens=1)
    long = make_request("long", 6)
    scheduler.add_request(short)
    scheduler.add_request(long)
    output = scheduler.schedule()  # short whole, long's first 2 tokens
    assert scheduler.update(output, {"short": 5}) == [short]
    assert short.status is RequestStatus.FINISHED_LENGTH and long.num_computed_tokens == 2


def test_a_request_alone_is_capped_by_the_pool_instead_of_preempting_itself_forever():
    scheduler, kv = make_scheduler(num_blocks=3)  # 2 blocks: 8 slots
    request = make_request("r", 6, max_tokens=None)
    scheduler.add_request(request)
    drain(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 9 and request.num_preemptions == 0  # the last token needs no slot
    assert kv.num_free_blocks == 2


def test_abort_frees_blocks_and_ignores_unknown_ids():
    scheduler, kv = make_scheduler(max_num_seqs=1)
    running = make_request("running", 5)
    waiting = make_request("waiting", 5)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler)
    assert kv.get_block_ids("running") == [1, 2]
    scheduler.finish_request("running", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("waiting", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("running", RequestStatus.FINISHED_ABORTED)  # already finished
    scheduler.finish_request("nobody", RequestStatus.FINISHED_ABORTED)
    assert running.status is waiting.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests() and scheduler.schedule().is_empty
    assert kv.num_free_blocks == 63
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_request("x", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_drops_the_step_for_that_request():
    scheduler, kv = make_scheduler()
    request = make_request("r", 8)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update(output, {"r": 5}) == []
    assert request.output_token_ids == [] and request.num_computed_tokens == 0
    assert kv.block_pool.num_cached_blocks == 0  # its blocks were never written
    assert kv.num_free_blocks == 63


def test_resumed_request_longer_than_the_budget_is_cut_even_without_chunking():
    scheduler, kv = make_scheduler(num_blocks=5, caching=False, max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = make_request("a", 2, max_tokens=12)
    b = make_request("b", 2, max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    plans = drain(scheduler)
    assert plans[7] == [("a", 1)] and b.num_preemptions == 1  # b had grown to 9 tokens by then
    assert plans[12:14] == [[("b", 8)], [("b", 1)]]  # 9 tokens never fit whole in a budget of 8
    assert len(a.output_token_ids) == 12 and b.output_token_ids == list(range(100, 112))
    assert kv.num_free_blocks == 4


def test_many_requests_on_a_tight_pool_all_finish_and_free_everything():
    scheduler, kv = make_scheduler(num_blocks=8, max_num_batched_tokens=16, max_num_seqs=4)
    shared = list(range(500, 508))
    requests = [make_request(f"r{i}", shared + [i] * (i % 5), max_tokens=3 + i % 4) for i in range(12)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(100):
        plan, _ = step(scheduler)
        assert sum(n for _, n in plan) <= 16 and len(plan) <= 4
        held = [block for block in kv.block_pool.blocks[1:] if block.ref_cnt > 0]
        assert len(held) + kv.num_free_blocks == 7
        for request in scheduler.running:
            assert len(kv.get_block_ids(request.request_id)) * 4 >= request.num_computed_tokens
        if not scheduler.has_unfinished_requests():
            break
    assert [len(r.output_token_ids) for r in requests] == [3 + i % 4 for i in range(12)]
    assert sum(r.num_preemptions for r in requests) > 0 and kv.num_hit_tokens > 0
    assert kv.num_free_blocks == 7


# ---- scheduling ahead: the next step scheduled while one is in flight ---------------------------
def run_ahead(scheduler, token_for=fake_token, max_num_steps=200):
    """The engine's loop with every step scheduled ahead of the one in flight; returns the plans.
    A step's tokens are drawn when it is scheduled (the device would compute them then), from the
    request's known tokens (placeholders excluded)."""
    def sample(output):
        return {s.request.request_id: token_for(s.request, s) for s in output.scheduled if s.samples}

    plans = []
    in_flight = scheduler.schedule()
    tokens = sample(in_flight)
    while in_flight is not None:
        assert len(plans) < max_num_steps, "scheduler made no progress"
        plans.append([(s.request.request_id, s.num_new_tokens) for s in in_flight.scheduled])
        following = scheduler.schedule_ahead(in_flight)
        following_tokens = sample(following)
        scheduler.update(in_flight, tokens)
        in_flight, tokens = (None, None) if following.is_empty else (following, following_tokens)
    return plans


def known_token(request, scheduled):
    # The token after position start + n - 1, from what is known: placeholders excluded.
    return 100 + scheduled.start + scheduled.num_new_tokens - request.num_prompt_tokens


def test_ahead_gives_the_tokens_and_steps_of_serial_scheduling():
    results = []
    for ahead in (False, True):
        scheduler, kv = make_scheduler(max_num_batched_tokens=8)
        reqs = [make_request(r, n, max_tokens=m) for r, n, m in (("a", 3, 6), ("b", 10, 2), ("c", 5, 1))]
        for r in reqs:
            scheduler.add_request(r)
        if ahead:
            plans = run_ahead(scheduler, known_token)
        else:
            plans = drain(scheduler, lambda r: 100 + r.num_tokens - r.num_prompt_tokens)
        results.append((plans, [r.output_token_ids for r in reqs], [r.status for r in reqs]))
        assert kv.num_free_blocks == kv.num_usable_blocks
        assert all(r.num_output_placeholders == 0 for r in reqs)
    assert results[0] == results[1]
    assert results[1][1][0] == [100, 101, 102, 103, 104, 105]


def test_ahead_placeholder_is_last_and_never_hashed():
    scheduler, kv = make_scheduler()
    a = make_request("a", 3, max_tokens=8)  # 3 prompt tokens: the first sampled token fills block 0
    scheduler.add_request(a)
    first = scheduler.schedule()
    second = scheduler.schedule_ahead(first)
    assert a.output_token_ids == [-1] and a.num_output_placeholders == 1 and a.num_computed_tokens == 3
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in second.scheduled] == [("a", 3, 1)]
    assert kv._num_cached_blocks.get("a", 0) == 0  # block 0 holds the placeholder: not cached
    scheduler.update(first, {"a": 7})
    assert a.output_token_ids == [7] and a.num_output_placeholders == 0
    scheduler.schedule_ahead(second)
    scheduler.update(second, {"a": 8})
    assert a.output_token_ids == [7, 8] and kv._num_cached_blocks["a"] == 1  # cached once known
    assert kv.block_pool.get_cached_block(kv._hashes(a, 1)[0]) is not None


def test_ahead_stop_token_in_flight_wastes_one_row_and_frees():
    scheduler, kv = make_scheduler()
    a = make_request("a", 4, max_tokens=10, params={"stop_token_ids": [55]})
    b = make_request("b", 4, max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    second = scheduler.schedule_ahead(first)
    assert [s.request.request_id for s in second.scheduled] == ["a", "b"]  # a's stop is not known yet
    received = scheduler.update(first, {"a": 55, "b": 1})
    assert [r.request_id for r in received] == ["a", "b"]
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == [55]
    third = scheduler.schedule_ahead(second)  # a's row of `second` is dropped
    assert [s.request.request_id for s in third.scheduled] == ["b"]
    received = scheduler.update(second, {"a": 9, "b": 2})
    assert [r.request_id for r in received] == ["b"] and a.output_token_ids == [55]
    assert b.output_token_ids == [1, 2]


def test_ahead_request_ending_by_length_is_not_scheduled_again():
    scheduler, kv = make_scheduler()
    a = make_request("a", 4, max_tokens=1)
    scheduler.add_request(a)
    first = scheduler.schedule()
    second = scheduler.schedule_ahead(first)
    assert second.is_empty
    scheduler.update(first, {"a": 3})
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [3]
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_ahead_abort_in_flight_drops_the_placeholder():
    scheduler, kv = make_scheduler()
    a = make_request("a", 4, max_tokens=5)
    scheduler.add_request(a)
    first = scheduler.schedule()
    scheduler.update(first, {"a": 1})
    second = scheduler.schedule()
    third = scheduler.schedule_ahead(second)
    assert a.output_token_ids == [1, -1]
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update(second, {"a": 2}) == [] and a.output_token_ids == [1]
    assert scheduler.schedule_ahead(third).is_empty  # a is finished: nothing advances
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_ahead_preempted_request_still_receives_its_token():
    # 2 usable blocks of 4: a and b hold one each; a's next decode needs a second block.
    scheduler, kv = make_scheduler(num_blocks=3)
    a, b = make_request("a", 3, max_tokens=4), make_request("b", 3, max_tokens=4, arrival_time=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    scheduler.update(first, {"a": 1, "b": 1})
    second = scheduler.schedule()  # decodes at position 3: the blocks are full after it
    third = scheduler.schedule_ahead(second)  # a needs a block: b (the tail) is preempted
    assert [s.request.request_id for s in third.scheduled] == ["a"] and b.status is RequestStatus.PREEMPTED
    received = scheduler.update(second, {"a": 2, "b": 2})
    assert [r.request_id for r in received] == ["a", "b"]
    assert b.output_token_ids == [1, 2] and b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    assert scheduler.waiting == [b]
