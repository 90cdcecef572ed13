"""Block tables of the sliding-window KV groups (engine.core.kv_groups), one per request.

Role: the part of the hybrid KV cache manager that frees what sliding layers no longer see.
`KVCacheManager` keeps the full-attention group's blocks as before and asks this class about
the sliding groups, which draw from the same `BlockPool`.

Invariants:
- A request's table in every sliding group has one entry per block of its context, like the
  full group's; entries before the window are None (the null block: id 0 in the tables the
  kernels read, inside the window mask, so never attended).
- A step whose first query is at position p sees keys from p - window + 1 on, so before a step
  every block whose last position is below that is released (`remove_skipped`): in decode a
  request holds at most ceil(window / block_size) + 1 blocks per sliding group.
- Sliding blocks are cached like full ones once a completed step wrote them, under a key
  derived from the block hash and the group (`group_key`), never published to routers: the
  routers index the full group's hashes.
- Prefix hits: a hit of k blocks needs, in every sliding group, the cached blocks from the
  first one the next query sees up to block k - 1 (`longest_hit`); where one is missing, the
  hit is cut back to the longest length for which they all are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from engine.core.block_pool import BlockPool, KVCacheBlock
from kvfleet.contracts.block_hash import DIGEST_SIZE, BlockHash

SlidingTable = list[KVCacheBlock | None]


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a sliding group's block: distinct per group, never a real hash."""
    return hashlib.blake2b(block_hash + b"kvfleet.sliding" + group.to_bytes(2, "little"),
                           digest_size=DIGEST_SIZE).digest()


class SlidingGroups:
    def __init__(self, pool: BlockPool, block_size: int, window: int, num_groups: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.window = window
        self.num_groups = num_groups  # sliding groups; their ids are 1..num_groups
        self.tables: dict[str, list[SlidingTable]] = {}
        self._num_cached: dict[str, int] = {}

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` (or any later one) attends."""
        return max(0, position - self.window + 1) // self.block_size

    def blocks_per_request(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most sliding blocks (all groups) a request of `num_tokens` holds at once."""
        span = -(-(self.window - 1 + min(max_step_tokens, num_tokens)) // self.block_size) + 1
        return self.num_groups * min(-(-num_tokens // self.block_size), span)

    # ------------------------------------------------------------------ prefix hits
    def longest_hit(self, hashes: Sequence[BlockHash], num_blocks: int) -> int:
        """The longest k <= num_blocks whose window before block k is cached in every group.

        Scans from the right: a miss at block j rules out every k in (j, current k], whose
        windows all contain j (the window's first block never moves left as k grows), so only
        the blocks of the windows tried are ever looked up.
        """
        known: dict[int, bool] = {}

        def cached(j: int) -> bool:
            if j not in known:
                known[j] = all(self.pool.get_cached_block(group_key(hashes[j], g)) is not None
                               for g in self._groups())
            return known[j]

        k = num_blocks
        while k > 0:
            first = self.first_needed_block(k * self.block_size)
            miss = next((j for j in range(k - 1, first - 1, -1) if not cached(j)), None)
            if miss is None:
                return k
            k = miss
        return 0

    def hit_tables(self, hashes: Sequence[BlockHash], num_blocks: int) -> list[SlidingTable]:
        """Per group, the hit's table: None before the window, the cached blocks after."""
        first = self.first_needed_block(num_blocks * self.block_size)
        tables = []
        for g in self._groups():
            table: SlidingTable = [None] * first
            for j in range(first, num_blocks):
                block = self.pool.get_cached_block(group_key(hashes[j], g))
                # `longest_hit` vouched for it, and nothing evicts between lookup and use.
                assert block is not None, f"sliding block {j} of group {g} left the cache"
                table.append(block)
            tables.append(table)
        return tables

    # ------------------------------------------------------------------ allocation
    def remove_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks no query from `num_computed_tokens` on attends."""
        first = self.first_needed_block(num_computed_tokens)
        for table in self.tables.get(request_id, ()):
            skipped = [b for b in table[:first] if b is not None]
            table[:first] = [None] * min(first, len(table))
            self.pool.free(reversed(skipped))

    def plan(
        self, request_id: str, hits: list[SlidingTable] | None, num_tokens: int
    ) -> tuple[int, int]:
        """(new blocks to allocate, free hit blocks to take) to cover `num_tokens` positions."""
        tables = hits if hits is not None else self.tables.get(request_id)
        held = len(tables[0]) if tables else 0
        num_new = self.num_groups * max(0, -(-num_tokens // self.block_size) - held)
        num_free_hits = sum(1 for t in hits or () for b in t if b is not None and b.ref_cnt == 0)
        return num_new, num_free_hits

    def commit(self, request_id: str, hits: list[SlidingTable] | None, num_tokens: int) -> None:
        """Take the hits and new blocks `plan` counted (the caller checked they fit)."""
        if hits is not None:
            self.pool.touch(b for t in hits for b in t if b is not None)
            self.tables[request_id] = hits
        tables = self.tables.setdefault(request_id, [[] for _ in self._groups()])
        num_new = max(0, -(-num_tokens // self.block_size) - len(tables[0]))
        for table in tables:
            table.extend(self.pool.allocate(num_new))

    def cache(self, request_id: str, hashes: Sequence[BlockHash], num_computed: int) -> None:
        """Register the full blocks a completed step wrote (see KVCacheManager)."""
        tables = self.tables.get(request_id)
        if not tables:
            return
        start = self._num_cached.get(request_id, 0)
        end = min(num_computed // self.block_size, len(hashes), len(tables[0]))
        for g, table in zip(self._groups(), tables, strict=True):
            for j in range(start, end):
                block = table[j]
                if block is not None:
                    self.pool.cache_block(block, group_key(hashes[j], g), publish=False)
        self._num_cached[request_id] = max(start, end)

    def free_beyond(self, request_id: str, num_tokens: int) -> None:
        keep = -(-num_tokens // self.block_size)
        for table in self.tables.get(request_id, ()):
            extra = [b for b in table[keep:] if b is not None]
            del table[keep:]
            self.pool.free(reversed(extra))

    def free(self, request_id: str) -> None:
        self._num_cached.pop(request_id, None)
        for table in self.tables.pop(request_id, ()):
            self.pool.free(reversed([b for b in table if b is not None]))

    # ------------------------------------------------------------------ views
    def block_ids(self, request_id: str) -> list[list[int]]:
        """Per sliding group, the table the kernels read (0 for released blocks)."""
        return [[0 if b is None else b.block_id for b in table]
                for table in self.tables.get(request_id, ())]

    def num_held(self, request_id: str) -> list[int]:
        return [sum(1 for b in table if b is not None) for table in self.tables.get(request_id, ())]

    def owned(self) -> Iterator[KVCacheBlock]:
        for tables in self.tables.values():
            for table in tables:
                yield from (b for b in table if b is not None)

    def _groups(self) -> range:
        return range(1, self.num_groups + 1)
