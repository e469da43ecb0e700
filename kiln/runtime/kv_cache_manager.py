"""KVCacheManager: each request's block table, and the prefix cache over full blocks.

A request's tokens fill its blocks in order; a full block is known by a hash chained through
every block before it, so equal hashes mean equal prefixes, not just equal blocks::

    block_size 4, 10 tokens, block table [3, 7, 1]

    tokens | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .  |
    block  |      3      |      7      |      1      |
    hash   | h0 = H(None,| h1 = H(h0,  | not full:   |
           |    t0..t3)  |    t4..t7)  | not cached  |

A request with a LoRA adapter roots its chain at the adapter's id instead of None (H(("lora", id),
t0..t3)): the K/V an adapter computes differ from the base model's, so two adapters (or an adapter
and the base) never share a block.

A block covering image placeholder tokens adds the content hashes of those images to its key
(H(parent, t0..t3, (image hashes))): placeholder ids are the same for every image, so the same
image hits and a different image does not.

Rules kept here:
- Requests are keyed by request_id; free() forgets everything about a request and is safe to call
  for a request that holds nothing.
- get_computed_blocks never returns the whole sequence: at least one token is left to compute, so
  the model produces logits to sample from.
- allocate_slots changes nothing when it returns None.
- A block is cached once its tokens are known, at the allocation that fills it (its K/V are
  written in that same step, before any request reads them). If that step never runs for the
  request (preempted or aborted before update), free() drops the hashes of the blocks that were
  not written, so the prefix cache never hands out unwritten K/V.
- After every request is freed, num_free_blocks is back to its starting value.
"""

from __future__ import annotations

from typing import Iterable, Optional

from kiln.runtime.block_pool import Block, BlockPool
from kiln.runtime.multimodal import features_overlapping
from kiln.runtime.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[Block]] = {}  # request_id -> block table
        self._block_ids: dict[str, list[int]] = {}  # request_id -> its block table's ids, as last returned
        self._block_hashes: dict[str, list[int]] = {}  # request_id -> chained hashes of full blocks
        self._num_cached_blocks: dict[str, int] = {}  # request_id -> leading blocks already cached
        self.num_queries_tokens = 0  # tokens of admitted requests, counted once per admission
        self.num_hit_tokens = 0  # of those, tokens found in the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of lendable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queries_tokens if self.num_queries_tokens else 0.0

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._blocks.get(request_id, [])]

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest cached run of the request's leading full blocks, and its length in tokens."""
        if (not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None
                or request.pooling is not None):
            return [], 0  # prompt logprobs and mean pooling need every prompt position computed
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks = []
        for block_hash in self._hashes(request, max_num_blocks):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        return computed_blocks, len(computed_blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Iterable[Block] = (),
        num_lookahead_tokens: int = 0,
    ) -> Optional[list[int]]:
        """Grow the request's table to hold num_computed_tokens + hits + num_new_tokens tokens, plus
        num_lookahead_tokens slots past the known tokens for proposed (speculative) ones.

        new_computed_blocks (from get_computed_blocks) are only passed when the request is admitted,
        before request.num_computed_tokens counts them. Returns the whole block id table, or None
        (changing nothing) when too few blocks are free. Blocks are cached only over known tokens,
        never over lookahead slots.
        """
        request_id = request.request_id
        held_blocks = self._blocks.get(request_id)
        if held_blocks and not num_lookahead_tokens and new_computed_blocks == ():
            # The common decode step: one more token that fits the blocks held, and no full block
            # newly cached. Checked and answered without touching the pool (the scheduler calls
            # this for every running request every step).
            num_tokens = request.num_computed_tokens + num_new_tokens
            if (0 < num_new_tokens and num_tokens <= request.num_tokens
                    and num_tokens <= len(held_blocks) * self.block_size
                    and (not self.enable_prefix_caching
                         or num_tokens // self.block_size <= self._num_cached_blocks.get(request_id, 0))):
                return self._block_ids[request_id][:]
        held_blocks = held_blocks or []
        computed_blocks = list(new_computed_blocks)
        if computed_blocks and (held_blocks or request.num_computed_tokens):
            raise ValueError(f"request {request_id}: cache hits can only be added when it is admitted")
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        if num_new_tokens <= 0 or num_tokens > request.num_tokens:
            raise ValueError(
                f"request {request_id}: cannot compute {num_new_tokens} new tokens "
                f"(computed {request.num_computed_tokens}, known {request.num_tokens})"
            )
        num_slots = num_tokens + num_lookahead_tokens
        num_new_blocks = max(0, _cdiv(num_slots, self.block_size) - len(held_blocks) - len(computed_blocks))
        # A hit on a free cached block takes it out of the free queue, so it costs a free block too.
        num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None

        if not held_blocks:
            self._record_admission(request, len(computed_blocks))
        self.block_pool.touch(computed_blocks)
        blocks = self._blocks.setdefault(request_id, [])
        blocks.extend(computed_blocks)
        blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        # Never over a placeholder (a token still in flight: Scheduler.schedule_ahead).
        known = request.num_tokens - request.num_output_placeholders
        self._cache_full_blocks(request, blocks, min(num_tokens, known) // self.block_size)
        ids = self._block_ids[request_id] = [block.block_id for block in blocks]
        return ids[:]

    def trim(self, request: Request) -> int:
        """Give back the blocks past the request's known tokens (lookahead slots whose proposed
        tokens were rejected); returns how many. They were never cached: caching stops at known tokens."""
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = _cdiv(request.num_tokens, self.block_size)
        extra = blocks[keep:]
        if extra:
            del blocks[keep:]
            self._block_ids[request.request_id] = [block.block_id for block in blocks]
            self.block_pool.free_blocks(reversed(extra))
        return len(extra)

    def free(self, request: Request) -> None:
        """Give back every block of the request, last block first, and forget the request."""
        request_id = request.request_id
        blocks = self._blocks.pop(request_id, [])
        self._block_ids.pop(request_id, None)
        num_written_blocks = request.num_computed_tokens // self.block_size
        for block in blocks[num_written_blocks:]:
            if block.ref_cnt == 1:
                self.block_pool.uncache_block(block)  # allocated for a step that never ran for it
        self.block_pool.free_blocks(reversed(blocks))
        self._block_hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; returns how many were dropped."""
        return self.block_pool.reset_prefix_cache()

    def _record_admission(self, request: Request, num_hit_blocks: int) -> None:
        if self.enable_prefix_caching:
            self.num_queries_tokens += request.num_tokens
            self.num_hit_tokens += num_hit_blocks * self.block_size

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_full_blocks: int) -> None:
        if not self.enable_prefix_caching:
            return
        first = self._num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= first:
            return
        hashes = self._hashes(request, num_full_blocks)
        for index in range(first, num_full_blocks):
            self.block_pool.cache_full_block(blocks[index], hashes[index])
        self._num_cached_blocks[request.request_id] = num_full_blocks

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first num_blocks full blocks, computed once each."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        size = self.block_size
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else (("lora", request.lora_id) if request.lora_id else None)
            token_ids = request.token_ids_slice(index * size, (index + 1) * size)
            key = (parent, tuple(token_ids))
            if request.mm_features:
                images = features_overlapping(request.mm_features, index * size, (index + 1) * size)
                key += tuple(f.mm_hash for f in images)
            hashes.append(hash(key))
        return hashes[:num_blocks]
