"""Swap space: where a preempted request's KV blocks wait in host memory.

Role: the host-side allocator and the per-request record of a swapped-out request. The KV
manager moves blocks (`engine.core.kv_cache_manager.KVCacheManager.swap_out` / `swap_in`);
this module only remembers, for each block position of a swapped request, whether the block
stayed on the device (it was shared: another request or a cache hit holds it too, so moving
it would free nothing) or went to a host block, with the hash it had.

Invariants:
- Every swap block is free or owned by exactly one swapped request's record.
- A kept device block stays referenced by the swapped request (its `ref_cnt` counts it), so
  it can be neither evicted nor reused while the request is swapped.
- Host blocks are released by the caller through the step's `TransferQueue` (deferred), never
  while a copy planned in the same step may still read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from engine.core.block_pool import KVCacheBlock
from kvfleet.contracts.block_hash import BlockHash


@dataclass(frozen=True)
class SwappedBlock:
    """One block position of a swapped request: kept on the device, or in a host block."""

    device_block: KVCacheBlock | None = None
    host_id: int | None = None
    block_hash: BlockHash | None = None


@dataclass
class SwapStats:
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    # Blocks a swap-in found still cached on the device (no copy needed).
    swap_in_cache_hits: int = 0


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"swap space needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id
        self.records: dict[str, list[SwappedBlock]] = {}
        # Released by their owners but still read by the current step's copies.
        self._releasing: list[int] = []
        self.stats = SwapStats()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self) -> int:
        return self._free.pop()

    def release_later(self, host_ids: list[int]) -> Callable[[], None]:
        """Mark blocks released; they become free when the returned callable runs (the
        step's TransferQueue.take)."""
        self._releasing.extend(host_ids)
        return partial(self._release, host_ids)

    def _release(self, host_ids: list[int]) -> None:
        for host_id in host_ids:
            self._releasing.remove(host_id)
        self._free.extend(host_ids)
        self._free.sort(reverse=True)

    def host_ids(self, request_id: str) -> list[int]:
        return [e.host_id for e in self.records.get(request_id, []) if e.host_id is not None]

    def check_integrity(self) -> None:
        owned = [h for rid in self.records for h in self.host_ids(rid)] + self._releasing
        if len(owned) != len(set(owned)) or set(owned) & set(self._free):
            raise AssertionError("swap space: a block is owned twice or both owned and free")
        if len(owned) + len(self._free) != self.num_blocks:
            raise AssertionError("swap space: free + owned + releasing != total")
