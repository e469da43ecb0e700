"""BlockPool on a toy pool of 8 blocks: block 0 is the null block, ids 1..7 are lent."""

import pytest

from kiln.runtime.block_pool import NULL_BLOCK_ID, BlockPool


def ids(blocks):
    return [block.block_id for block in blocks]


def test_fresh_pool_lends_all_but_the_null_block():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    assert pool.num_usable_blocks == 7
    assert pool.num_free_blocks == 7
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.null_block.block_id == NULL_BLOCK_ID


def test_get_new_blocks_takes_from_the_head_with_one_reference():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    assert [block.ref_cnt for block in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="only 4 are free"):
        pool.get_new_blocks(5)
    assert pool.num_free_blocks == 4  # the failed call took nothing


def test_free_in_reverse_order_puts_the_tail_first_in_line_for_eviction():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert ids(pool.get_new_blocks(5)) == [4, 5, 6, 7, 3]


def test_shared_block_is_free_only_after_the_last_reference():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and 1 not in pool.free_block_ids()
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.free_block_ids()[-1] == 1
    with pytest.raises(ValueError, match="not held"):
        pool.free_blocks([block])
    with pytest.raises(ValueError, match="not held"):
        pool.free_blocks([pool.null_block])


def test_touch_takes_a_cached_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.cache_full_block(blocks[1], block_hash=222)
    pool.free_blocks(reversed(blocks))  # queue: 4 5 6 7 3 2 1
    hit = pool.get_cached_block(222)
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 1]


def test_eviction_follows_lru_order_and_drops_the_hash():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    blocks = pool.get_new_blocks(7)  # every block
    for block in blocks:
        pool.cache_full_block(block, block_hash=100 + block.block_id)
    pool.free_blocks([blocks[4], blocks[0], blocks[2]])  # free 5, then 1, then 3
    assert pool.free_block_ids() == [5, 1, 3]
    (first,) = pool.get_new_blocks(1)
    assert first.block_id == 5 and first.block_hash is None
    assert pool.get_cached_block(105) is None
    assert pool.get_cached_block(101) is blocks[0]  # not yet evicted
    assert ids(pool.get_new_blocks(2)) == [1, 3]
    assert pool.get_cached_block(101) is None and pool.get_cached_block(103) is None
    assert pool.num_cached_blocks == 4  # blocks 2, 4, 6, 7, still in use


def test_one_block_per_hash_the_copy_stays_uncached():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    first, copy = pool.get_new_blocks(2)
    pool.cache_full_block(first, block_hash=7)
    pool.cache_full_block(copy, block_hash=7)
    assert pool.get_cached_block(7) is first
    assert copy.block_hash is None
    pool.cache_full_block(first, block_hash=7)  # caching again is a no-op
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_full_block(first, block_hash=8)


def test_caching_off_never_finds_anything():
    pool = BlockPool(num_blocks=8, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, block_hash=1)
    assert block.block_hash is None and pool.get_cached_block(1) is None


def test_reset_prefix_cache_drops_hashes_but_keeps_blocks_and_queue():
    pool = BlockPool(num_blocks=8, enable_caching=True)
    in_use, freed = pool.get_new_blocks(2)
    pool.cache_full_block(in_use, block_hash=1)
    pool.cache_full_block(freed, block_hash=2)
    pool.free_blocks([freed])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    assert in_use.block_hash is None and in_use.ref_cnt == 1
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2]


def test_pool_needs_room_beside_the_null_block():
    with pytest.raises(ValueError, match="null block"):
        BlockPool(num_blocks=1, enable_caching=True)
