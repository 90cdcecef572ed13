"""Maps requests to KV blocks: prefix lookup, slot allocation, caching and freeing.

Invariants:
- A request's blocks cover positions [0, num_computed_tokens + scheduled tokens) in order;
  block i holds positions [i * block_size, (i + 1) * block_size).
- Prefix lookup never returns the block holding the request's last known token: that token must
  be computed to produce logits.
- A block becomes a cache hit only once its KV has been written by a step that completed:
  `allocate_slots` registers nothing; the scheduler calls `cache_computed_blocks` after a step's
  results are in, for full blocks below `num_computed_tokens`. A step that raises therefore
  leaves its blocks unhashed (they return to the front of the free queue, are never published
  and never hit), so a failed step cannot poison the cache.
- Hit blocks are referenced before new blocks are taken, so a request's own hits are never
  evicted to make room for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.request import Request


@dataclass(frozen=True)
class KVCacheEvents:
    """Hashes cached and evicted since the previous report, in order."""

    stored: list[BlockHash]
    removed: list[BlockHash]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been offered to the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: (blocks, number of tokens they hold)."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request holding `num_tokens` could ever fit in the whole pool."""
        return self._blocks_for(num_tokens) <= self.pool.num_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens; None if blocks run out.

        `new_computed_blocks` are prefix hits for a request being admitted; they count as
        computed tokens ahead of the new ones.
        """
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = self._blocks_for(num_computed + num_new_tokens)
        num_new_blocks = max(0, num_needed - len(blocks) - len(hits))
        # Free hit blocks leave the queue when touched, so they cannot also be allocated.
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(hits)
        blocks.extend(hits)
        new_blocks = self.pool.allocate(num_new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV a completed step has written.

        Call only after `request.num_computed_tokens` counts tokens of finished steps: a hash
        registered here can be served to other requests (and is published to routers).
        """
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(
            request.num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks)
        )
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> KVCacheEvents:
        stored, removed = self.pool.take_events()
        return KVCacheEvents(stored=stored, removed=removed)

    def check_integrity(self) -> None:
        """free + in use == total, and every in-use reference is owned by some request."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise AssertionError(f"{block} has {refs.get(block.block_id, 0)} owners")
        num_used = sum(1 for block in self.pool.blocks if block.ref_cnt > 0)
        if num_used + self.pool.num_free_blocks != self.pool.num_blocks:
            raise AssertionError("free + in use != total")

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
