"""KVCacheManager on a toy pool: 8 blocks (ids 1..7 lent, 0 is the null block) of 4 tokens."""

import pytest

from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.request import Request
from kiln.sampling_params import SamplingParams

PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks


def make_request(request_id, prompt_token_ids):
    return Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=8))


def run_chunk(kv, request, num_new_tokens, computed_blocks=()):
    """Allocate like the scheduler, then advance as update() would after the step."""
    block_ids = kv.allocate_slots(request, num_new_tokens, computed_blocks)
    assert block_ids is not None
    request.num_computed_tokens += len(list(computed_blocks)) * kv.block_size + num_new_tokens
    return block_ids


def ref_cnts(kv, block_ids):
    return [kv.block_pool.blocks[block_id].ref_cnt for block_id in block_ids]


@pytest.fixture
def kv():
    return KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)


def test_prompt_gets_blocks_in_order_and_full_blocks_are_cached(kv):
    a = make_request("a", PREFIX + [19, 20])
    assert run_chunk(kv, a, 10) == [1, 2, 3]
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.num_free_blocks == 4
    assert kv.usage == pytest.approx(3 / 7)
    assert [kv.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, False]


def test_decode_fills_the_last_block_then_takes_a_new_one(kv):
    a = make_request("a", PREFIX + [19, 20])
    run_chunk(kv, a, 10)
    a.output_token_ids.append(21)
    assert run_chunk(kv, a, 1) == [1, 2, 3]  # token 10 goes into block 3
    a.output_token_ids.append(22)
    assert run_chunk(kv, a, 1) == [1, 2, 3]  # block 3 is now full: cached
    assert kv.block_pool.blocks[3].block_hash is not None
    a.output_token_ids.append(23)
    assert run_chunk(kv, a, 1) == [1, 2, 3, 4]


def test_shared_prefix_reuses_cached_blocks(kv):
    a = make_request("a", PREFIX + [19, 20])
    b = make_request("b", PREFIX + [29, 30, 31])
    run_chunk(kv, a, 10)
    computed, num_computed_tokens = kv.get_computed_blocks(b)
    assert [block.block_id for block in computed] == [1, 2]
    assert num_computed_tokens == 8
    assert run_chunk(kv, b, 3, computed) == [1, 2, 4]
    assert ref_cnts(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert kv.num_free_blocks == 3
    assert (kv.num_queries_tokens, kv.num_hit_tokens) == (21, 8)
    assert kv.hit_rate == pytest.approx(8 / 21)


def test_hits_never_cover_the_whole_sequence(kv):
    a = make_request("a", PREFIX + [19])
    run_chunk(kv, a, 9)
    same = make_request("same", PREFIX)  # both blocks cached, but one token must be left to compute
    computed, num_computed_tokens = kv.get_computed_blocks(same)
    assert [block.block_id for block in computed] == [1]
    assert num_computed_tokens == 4


def test_freeing_gives_blocks_back_tail_first_and_restores_the_free_count(kv):
    a = make_request("a", PREFIX + [19, 20])
    b = make_request("b", PREFIX + [29, 30, 31])
    run_chunk(kv, a, 10)
    run_chunk(kv, b, 3, kv.get_computed_blocks(b)[0])
    kv.free(a)
    assert kv.block_pool.free_block_ids() == [5, 6, 7, 3]  # 1 and 2 are still held by b
    assert ref_cnts(kv, [1, 2]) == [1, 1]
    kv.free(b)
    assert kv.block_pool.free_block_ids() == [5, 6, 7, 3, 4, 2, 1]
    assert kv.num_free_blocks == 7
    assert kv.get_block_ids("b") == []
    kv.free(b)  # freeing twice is harmless: b holds nothing
    assert kv.num_free_blocks == 7


def test_hit_on_a_free_cached_block_revives_it(kv):
    a = make_request("a", PREFIX + [19, 20])
    run_chunk(kv, a, 10)
    kv.free(a)  # queue: 4 5 6 7 3 2 1, blocks 1 and 2 still cached
    c = make_request("c", PREFIX + [40])
    computed, _ = kv.get_computed_blocks(c)
    assert run_chunk(kv, c, 1, computed) == [1, 2, 4]
    assert kv.block_pool.free_block_ids() == [5, 6, 7, 3]
    assert ref_cnts(kv, [1, 2, 4]) == [1, 1, 1]


def test_lru_eviction_drops_the_tail_of_a_freed_request_first(kv):
    a = make_request("a", PREFIX + [19, 20, 21, 22])  # three full blocks: 1, 2, 3
    run_chunk(kv, a, 12)
    kv.free(a)  # queue: 4 5 6 7 3 2 1
    filler = make_request("filler", list(range(100, 120)))  # five blocks: 4 5 6 7, then evicts 3
    assert run_chunk(kv, filler, 20) == [4, 5, 6, 7, 3]
    again = make_request("again", PREFIX + [19, 20, 21, 22, 23])
    computed, num_computed_tokens = kv.get_computed_blocks(again)
    assert [block.block_id for block in computed] == [1, 2]  # block 3 (a's tail) was evicted
    assert num_computed_tokens == 8


def test_failed_allocation_changes_nothing(kv):
    a = make_request("a", PREFIX + [19, 20])
    run_chunk(kv, a, 10)
    kv.free(a)  # 1 and 2 cached and free
    big = make_request("big", list(range(100, 120)))
    run_chunk(kv, big, 20)  # takes 4 5 6 7 3: blocks 1 and 2 are the only free ones
    c = make_request("c", PREFIX + [40, 41, 42, 43, 44])
    computed, _ = kv.get_computed_blocks(c)
    assert [block.block_id for block in computed] == [1, 2]
    # Reviving 1 and 2 uses both free blocks; the 5 new tokens need two more.
    assert kv.allocate_slots(c, 5, computed) is None
    assert kv.num_free_blocks == 2
    assert ref_cnts(kv, [1, 2]) == [0, 0]
    assert kv.get_block_ids("c") == []
    assert kv.num_queries_tokens == 30  # a and big were admitted, c was not


def test_blocks_of_a_step_that_never_ran_are_not_left_in_the_cache(kv):
    a = make_request("a", PREFIX + [19, 20])
    assert kv.allocate_slots(a, 10) == [1, 2, 3]  # blocks 1 and 2 cached at allocation
    kv.free(a)  # num_computed_tokens is still 0: the K/V were never written
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("b", PREFIX + [19])) == ([], 0)


def test_reset_prefix_cache_forgets_every_hit(kv):
    a = make_request("a", PREFIX + [19])
    run_chunk(kv, a, 9)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(make_request("b", PREFIX + [19])) == ([], 0)


def test_caching_off_finds_no_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", PREFIX + [19])
    run_chunk(kv, a, 9)
    assert kv.get_computed_blocks(make_request("b", PREFIX + [19])) == ([], 0)
    assert kv.hit_rate == 0.0


def test_bad_allocations_are_refused(kv):
    a = make_request("a", PREFIX + [19])
    with pytest.raises(ValueError, match="cannot compute 10 new tokens"):
        kv.allocate_slots(a, 10)
    run_chunk(kv, a, 9)
    b = make_request("b", PREFIX + [19])
    computed, _ = kv.get_computed_blocks(b)
    run_chunk(kv, b, 1, computed)
    with pytest.raises(ValueError, match="only be added when it is admitted"):
        kv.allocate_slots(b, 1, computed)
