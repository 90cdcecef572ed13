"""The host tier of the prefix cache: evicted device blocks live on here, in LRU order.

Role: bookkeeping only (which hash sits in which host block); the copies are planned through
`engine.kv_tiers.transfer.TransferQueue` by the KV manager. When the device pool evicts a cached
block, `offload` gives it a host block (taking a free one, else evicting the least recently
used unpinned one) and the device-to-host copy runs before the slot is overwritten. A later
prompt whose prefix misses on the device but hits here reloads the blocks (host-to-device)
instead of computing them.

Invariants:
- Every tier block is free or holds exactly one hash; `num_free + len(entries) == num_blocks`.
- Order of `_entries` is LRU first; a hit (`touch`) or a re-offload moves a hash to the end.
- A pinned block (being reloaded in the current step) is never evicted; pins are dropped
  when the step's transfer plan is taken.
- Ids handed out are global host ids: tier-relative id + `offset` (the swap space comes first).
- `stored_events` / `removed_events` list hashes that entered / left the tier since the last
  `take_events`, so Redis can tell which tier holds a block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvfleet.contracts.block_hash import BlockHash


@dataclass
class HostTierStats:
    hits: int = 0  # blocks found in the tier by a prefix lookup that used them
    misses: int = 0  # lookups that missed on the device and found nothing here either
    evictions: int = 0  # blocks dropped from the tier to make room
    stored: int = 0  # blocks written into the tier


class HostKVTier:
    def __init__(self, num_blocks: int, offset: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"host tier needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.offset = offset
        self._free = list(range(offset + num_blocks - 1, offset - 1, -1))  # pop() -> lowest
        self._entries: OrderedDict[BlockHash, int] = OrderedDict()
        self._pins: dict[int, int] = {}
        self.stats = HostTierStats()
        self.stored_events: list[BlockHash] = []
        self.removed_events: list[BlockHash] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return len(self._entries) / self.num_blocks

    def get(self, block_hash: BlockHash) -> int | None:
        return self._entries.get(block_hash)

    def hashes(self) -> list[BlockHash]:
        """Every hash held, LRU first."""
        return list(self._entries)

    def offload(self, block_hash: BlockHash) -> int | None:
        """Reserve a host block for an evicted device block; None when no copy is needed.

        None means either the hash is already here (refreshed to most recently used) or every
        block is pinned by this step's reloads (the block is then lost, as without a tier).
        """
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return None
        host_id = self._free.pop() if self._free else self._evict_lru()
        if host_id is None:
            return None
        self._entries[block_hash] = host_id
        self.stored_events.append(block_hash)
        self.stats.stored += 1
        return host_id

    def _evict_lru(self) -> int | None:
        for block_hash, host_id in self._entries.items():
            if host_id not in self._pins:
                del self._entries[block_hash]
                self.removed_events.append(block_hash)
                self.stats.evictions += 1
                return host_id
        return None

    def pin(self, host_id: int) -> None:
        """Keep `host_id` from eviction until `unpin` (a reload reads it this step)."""
        self._pins[host_id] = self._pins.get(host_id, 0) + 1

    def unpin(self, host_id: int) -> None:
        left = self._pins[host_id] - 1
        if left:
            self._pins[host_id] = left
        else:
            del self._pins[host_id]

    def touch(self, block_hash: BlockHash) -> None:
        self._entries.move_to_end(block_hash)

    def clear(self) -> None:
        """Forget every block (reset_prefix_cache); refused by the caller while pinned."""
        for block_hash, host_id in self._entries.items():
            self.removed_events.append(block_hash)
            self._free.append(host_id)
        self._entries.clear()
        self._free.sort(reverse=True)

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        stored, removed = self.stored_events, self.removed_events
        self.stored_events, self.removed_events = [], []
        return stored, removed

    def check_integrity(self) -> None:
        held = list(self._entries.values())
        if len(set(held)) != len(held) or set(held) & set(self._free):
            raise AssertionError("host tier: a block is held twice or both held and free")
        if len(held) + len(self._free) != self.num_blocks:
            raise AssertionError("host tier: free + held != total")
        if any(not self.offset <= i < self.offset + self.num_blocks for i in held + self._free):
            raise AssertionError("host tier: block id out of range")
        if self._pins and any(p not in set(held) for p in self._pins):
            raise AssertionError("host tier: a pinned block holds nothing")
