"""One simulated engine's prefix cache: block hashes in an LRU of the engine's real capacity.

Role: what `engine.core.block_pool` does for prefix caching, reduced to bookkeeping. A block is
pinned while a request uses it (reference counted), free once no request does; free blocks
stay cached (hits) until a new allocation needs their space, oldest first (LRU). Blocks being
computed count against the capacity without a hash ("anonymous") until `store` names them.

Invariants:
- len(pinned) + anonymous + len(free) <= capacity at all times.
- `changes` holds the net stored (True) / evicted (False) events since the last `take_changes`,
  last state winning, exactly what an engine hands its Redis publisher each step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


class PrefixCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1 block")
        self.capacity = capacity
        self._free: OrderedDict[BlockHash, None] = OrderedDict()  # oldest first
        self._pinned: dict[BlockHash, int] = {}
        self._anonymous = 0
        self.changes: dict[BlockHash, bool] = {}

    @property
    def used(self) -> int:
        """Blocks in use by requests (vLLM's usage: cached free blocks count as free)."""
        return len(self._pinned) + self._anonymous

    @property
    def num_cached(self) -> int:
        return len(self._pinned) + len(self._free)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._pinned or block_hash in self._free

    def match(self, hashes: Sequence[BlockHash], limit: int) -> int:
        """Leading blocks of `hashes[:limit]` the cache holds."""
        n = 0
        for h in hashes[:limit]:
            if h not in self._pinned and h not in self._free:
                break
            n += 1
        return n

    def can_allocate(self, hits: Sequence[BlockHash], new_blocks: int) -> bool:
        """Whether pinning `hits` and `new_blocks` more fits (free blocks are evictable)."""
        reclaimed = sum(1 for h in hits if h in self._free)
        return self.used + reclaimed + new_blocks <= self.capacity

    def acquire(self, hits: Sequence[BlockHash], new_blocks: int) -> None:
        for h in hits:
            self._pin(h)
        self._anonymous += new_blocks
        self._evict_to_fit()

    def store(self, block_hash: BlockHash) -> None:
        """An anonymous block of the caller is now computed and named `block_hash`."""
        self._anonymous -= 1
        if block_hash not in self._pinned and block_hash not in self._free:
            self.changes[block_hash] = True
        self._pin(block_hash)  # a duplicate computed concurrently: its copy is dropped

    def release(self, hashes: Sequence[BlockHash], anonymous: int) -> None:
        for h in hashes:
            count = self._pinned[h] - 1
            if count:
                self._pinned[h] = count
            else:
                del self._pinned[h]
                self._free[h] = None  # most recently used last
        self._anonymous -= anonymous

    def take_changes(self) -> dict[BlockHash, bool]:
        changes, self.changes = self.changes, {}
        return changes

    def hashes(self) -> list[BlockHash]:
        return [*self._pinned, *self._free]

    def _pin(self, h: BlockHash) -> None:
        if h in self._free:
            del self._free[h]
        self._pinned[h] = self._pinned.get(h, 0) + 1

    def _evict_to_fit(self) -> None:
        while self.used + len(self._free) > self.capacity and self._free:
            h, _ = self._free.popitem(last=False)
            self.changes[h] = False
