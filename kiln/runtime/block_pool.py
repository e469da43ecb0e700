"""BlockPool: every KV block, its reference count, the free queue and the prefix-cache map.

Rules kept here:
- Block 0 is the null block. It is never handed out and never freed, so the model runner may pad
  block tables and slot mappings with id 0 (padded CUDA-graph batches): padding writes land in a
  block no request reads. A pool of ``num_blocks`` therefore lends ``num_blocks - 1`` blocks.
- A block is free exactly when its ref_cnt is 0, and every free block sits in the free queue.
- The free queue is in LRU order: get_new_blocks takes from the head, freed blocks join the tail,
  and a cached free block that is hit again leaves the queue from the middle in O(1).
- A free block keeps its hash, so it can still be hit, until it is taken off the head (eviction)
  or reset_prefix_cache drops every hash.
- One block per hash: ``block.block_hash is not None`` exactly when the map points back at that
  block. A second block filled with the same tokens stays uncached (a private copy).

Free queue after a request with block table [3, 7, 1] is freed (3 and 7 full and cached, 1 partly
filled). Its blocks join last-first, so its tail is evicted before its prefix::

    head -> [2] [5 h=a1] [1] [7 h=c1] [3 h=c0] <- tail
             |               '-- the freed request --'
             taken first        (its prefix, 3, lives longest)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

NULL_BLOCK_ID = 0


@dataclass(eq=False)
class Block:
    """One KV page of block_size slots. Compared by identity: two blocks are never the same page."""

    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[int] = None  # set only while the block is findable in the prefix cache


class BlockPool:
    """Owns all blocks; callers hold Block objects and give them back through free_blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # pinned: it never reaches 0, so it never enters the free queue
        # block_id -> Block; insertion order is the LRU order, head first.
        self._free_queue: OrderedDict[int, Block] = OrderedDict(
            (block.block_id, block) for block in self.blocks[1:]
        )
        self._cached_blocks: dict[int, Block] = {}  # block_hash -> the one block holding those tokens

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be lent: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Take num_blocks from the head of the free queue, evicting their hashes; ref_cnt becomes 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self.uncache_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (a prefix-cache hit); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block. Blocks reaching 0 join the queue tail in the order
        given, so pass a request's blocks last-first to have its tail evicted before its prefix."""
        for block in blocks:
            if block is self.null_block or block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is not held (ref_cnt={block.ref_cnt})")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def cache_full_block(self, block: Block, block_hash: int) -> None:
        """Make a full block findable by its hash; no-op when caching is off or the hash is taken."""
        if not self.enable_caching or block.block_hash == block_hash:
            return
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already cached under another hash")
        if block_hash in self._cached_blocks:
            return  # an identical block is already cached; this one stays a private copy
        block.block_hash = block_hash
        self._cached_blocks[block_hash] = block

    def get_cached_block(self, block_hash: int) -> Optional[Block]:
        return self._cached_blocks.get(block_hash)

    def uncache_block(self, block: Block) -> None:
        """Make a block unfindable (its contents are about to change or were never written)."""
        if block.block_hash is not None:
            del self._cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Drop every hash, in use or free; returns how many blocks were uncached."""
        num_dropped = len(self._cached_blocks)
        for block in self._cached_blocks.values():
            block.block_hash = None
        self._cached_blocks.clear()
        return num_dropped

    def free_block_ids(self) -> list[int]:
        """The free queue, head first (for tests and debugging)."""
        return list(self._free_queue)
