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

Memory tiers (both optional; without them nothing below runs):
- Host tier (`host_tier`): a cached device block that is evicted is copied to the host tier
  first (`BlockPool.on_evict`). A prefix lookup continues past a device miss into the tier
  (`HostHit`); admitting such a request allocates a fresh device block per host hit and plans
  the reload. Reloaded blocks get their hash back like computed ones, once the step completes.
- Swap space (`swap`): `swap_out` moves the blocks a preempted request alone holds to host
  blocks (shared ones stay in place, still referenced), `swap_in` brings them back into fresh
  device blocks, or onto the same hash's block if the device still caches it.
- Copies are planned into `transfers` and run before the next forward pass (see
  engine.kv_tiers.transfer for the ordering guarantees).

Sliding-window KV (`groups`, engine.core.kv_groups; without it nothing below runs):
- `req_to_blocks` is the full-attention group's table; `sliding` holds the sliding groups'
  tables, drawn from the same pool (engine.core.sliding_blocks). Allocation checks both
  against the free blocks at once, so a request gets all of its groups' blocks or none.
- A prefix hit is cut to what every sliding group still caches inside the window.
- Neither memory tier nor a KV import runs with it: they move one table's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.kv_groups import KVGroupLayout
from engine.core.request import Request
from engine.core.sliding_blocks import SlidingGroups, SlidingTable
from engine.kv_tiers.host_tier import HostKVTier
from engine.kv_tiers.swap_space import SwappedBlock, SwapSpace
from engine.kv_tiers.transfer import TransferQueue
from kvfleet.contracts.block_hash import BlockHash


@dataclass(frozen=True)
class KVCacheEvents:
    """Hashes cached and evicted since the previous report, in order."""

    stored: list[BlockHash]
    removed: list[BlockHash]
    # The same for the host tier: a hash may be in both tiers (reloaded, still on the host).
    stored_host: list[BlockHash] = field(default_factory=list)
    removed_host: list[BlockHash] = field(default_factory=list)

    def extend(self, more: KVCacheEvents) -> None:
        """Append `more` after these events: one report covering both, still in order."""
        self.stored.extend(more.stored)
        self.removed.extend(more.removed)
        self.stored_host.extend(more.stored_host)
        self.removed_host.extend(more.removed_host)


@dataclass(frozen=True)
class HostHit:
    """A prefix block found in the host tier: reloaded into a fresh device block on admission."""

    host_id: int
    block_hash: BlockHash


PrefixHit = KVCacheBlock | HostHit


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached on the device
    host_hits: int = 0  # tokens found in the host tier (reloaded, not computed)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        *,
        host_tier: HostKVTier | None = None,
        swap: SwapSpace | None = None,
        groups: KVGroupLayout | None = None,
        max_step_tokens: int = 2048,
    ) -> None:
        if groups is not None and (host_tier is not None or swap is not None):
            raise ValueError("sliding-window KV groups cannot run with host KV tiers or swap")
        self.block_size = block_size
        self.max_step_tokens = max_step_tokens
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.host_tier = host_tier if enable_caching else None
        self.swap = swap
        self.transfers = TransferQueue()
        if self.host_tier is not None:
            self.pool.on_evict = self._offload_evicted
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been offered to the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self.groups = groups
        self.sliding = (
            SlidingGroups(self.pool, block_size, groups.window, groups.num_sliding_groups)
            if groups is not None else None
        )

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_tables(self) -> int:
        """Block tables per request: 1, or 1 + the sliding-window groups."""
        return 1 if self.sliding is None else 1 + self.sliding.num_groups

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[PrefixHit], int]:
        """Longest cached prefix of the request: (blocks, number of tokens they hold).

        With a host tier, each position is looked up on the device first, then in the tier.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[PrefixHit] = []
        tier = self.host_tier
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is not None:
                hits.append(block)
                continue
            host_id = None if tier is None else tier.get(block_hash)
            if host_id is None:
                break
            hits.append(HostHit(host_id, block_hash))
        if self.sliding is not None and hits:
            del hits[self.sliding.longest_hit(request.block_hashes, len(hits)):]
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, hits: list[PrefixHit]) -> None:
        num_host = sum(1 for hit in hits if isinstance(hit, HostHit))
        self.stats.queries += num_tokens
        self.stats.hits += (len(hits) - num_host) * self.block_size
        self.stats.host_hits += num_host * self.block_size
        tier = self.host_tier
        if tier is not None and len(hits) < (num_tokens - 1) // self.block_size:
            tier.stats.misses += 1

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request holding `num_tokens` could ever fit in the whole pool."""
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Most blocks a request of `num_tokens` holds at once (every group; a sliding
        group at most a window and a step's tokens)."""
        sliding = (0 if self.sliding is None
                   else self.sliding.blocks_per_request(num_tokens, self.max_step_tokens))
        return self._blocks_for(num_tokens) + sliding

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[PrefixHit] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens; None if blocks run out.

        `new_computed_blocks` are prefix hits for a request being admitted; they count as
        computed tokens ahead of the new ones. Host-tier hits each take a fresh device block
        (returned among the new blocks) that is filled by a reload before the step runs.
        """
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = self._blocks_for(num_computed + num_new_tokens)
        num_new_blocks = max(0, num_needed - len(blocks) - len(hits))
        device_hits = [h for h in hits if isinstance(h, KVCacheBlock)]
        num_host_hits = len(hits) - len(device_hits)
        # Free hit blocks leave the queue when touched, so they cannot also be allocated.
        num_free_hits = sum(1 for block in device_hits if block.ref_cnt == 0)
        sliding_hits, num_sliding = self._plan_sliding(request, len(hits),
                                                       num_computed + num_new_tokens)
        if (num_new_blocks + num_host_hits + num_sliding[0]
                > self.pool.num_free_blocks - num_free_hits - num_sliding[1]):
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(device_hits)
        if self.sliding is not None:
            self.sliding.commit(request.request_id, sliding_hits, num_computed + num_new_tokens)
        if num_host_hits:
            reloaded = self._reload_host_hits(hits)
            blocks.extend(reloaded)
        else:
            blocks.extend(device_hits)
        new_blocks = self.pool.allocate(num_new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def _plan_sliding(
        self, request: Request, num_hits: int, num_tokens: int
    ) -> tuple[list[SlidingTable] | None, tuple[int, int]]:
        """The sliding groups' hit tables and (new blocks, free hit blocks) for
        `allocate_slots`, after releasing the blocks that left the window."""
        if self.sliding is None:
            return None, (0, 0)
        self.sliding.remove_skipped(request.request_id, request.num_computed_tokens)
        hits = self.sliding.hit_tables(request.block_hashes, num_hits) if num_hits else None
        return hits, self.sliding.plan(request.request_id, hits, num_tokens)

    def _reload_host_hits(self, hits: list[PrefixHit]) -> list[KVCacheBlock]:
        """Device blocks for `hits` in order; host hits get fresh blocks and a planned reload."""
        tier = self.host_tier
        assert tier is not None
        # Pin first: allocating below may evict device blocks into the tier, which must not
        # reuse a host block this step still has to read.
        for hit in hits:
            if isinstance(hit, HostHit):
                tier.pin(hit.host_id)
                self.transfers.defer(partial(tier.unpin, hit.host_id))
        out: list[KVCacheBlock] = []
        for hit in hits:
            if isinstance(hit, KVCacheBlock):
                out.append(hit)
                continue
            (block,) = self.pool.allocate(1)
            self.transfers.copy_to_device(hit.host_id, block.block_id, swap=False)
            tier.touch(hit.block_hash)
            tier.stats.hits += 1
            out.append(block)
        return out

    def _offload_evicted(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """BlockPool.on_evict: save an evicted cached block in the host tier."""
        assert self.host_tier is not None
        host_id = self.host_tier.offload(block_hash)
        if host_id is not None:
            self.transfers.copy_to_host(block.block_id, host_id, swap=False)

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
        if self.sliding is not None:
            self.sliding.cache(request.request_id, request.block_hashes,
                               request.num_computed_tokens)

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` positions (speculative
        decoding's rollback: they hold only rejected drafts' KV and were never cached)."""
        if self.sliding is not None:
            self.sliding.free_beyond(request.request_id, num_tokens)
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self._blocks_for(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        assert self._num_cached_blocks.get(request.request_id, 0) <= keep
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(extra))

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        if self.sliding is not None:
            self.sliding.free(request.request_id)
        if self.swap is not None and request.request_id in self.swap.records:
            self.drop_swapped(request)

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, request: Request) -> bool:
        """Whether the swap space has room for the blocks `request` alone holds."""
        if self.swap is None:
            return False
        blocks = self.req_to_blocks.get(request.request_id, [])
        return sum(1 for block in blocks if block.ref_cnt == 1) <= self.swap.num_free

    def swap_out(self, request: Request) -> int:
        """Move the request's unshared blocks to swap space; returns how many moved.

        Shared blocks stay on the device, still referenced by the request. Moved blocks are
        freed (cached ones stay cached, LRU) once their copy is planned.
        """
        swap = self.swap
        assert swap is not None
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_full = request.num_computed_tokens // self.block_size
        record: list[SwappedBlock] = []
        moved: list[KVCacheBlock] = []
        for index, block in enumerate(blocks[: self._blocks_for(request.num_computed_tokens)]):
            if block.ref_cnt > 1:
                record.append(SwappedBlock(device_block=block))
                continue
            host_id = swap.allocate()
            self.transfers.copy_to_host(block.block_id, host_id, swap=True)
            # The request's own hash, even if the block itself went unregistered (a duplicate):
            # swap-in reuses any device block still caching that content.
            block_hash = request.block_hashes[index] if index < num_full else None
            record.append(SwappedBlock(host_id=host_id, block_hash=block_hash))
            moved.append(block)
        # Blocks past the computed tokens hold nothing yet: freed without a copy.
        self.pool.free(reversed(moved + blocks[len(record):]))
        swap.records[request.request_id] = record
        swap.stats.swapped_out_blocks += len(moved)
        return len(moved)

    def swap_in(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Bring a swapped request back with room for `num_new_tokens`; None if blocks run out."""
        swap = self.swap
        assert swap is not None
        record = swap.records[request.request_id]
        resident = [
            self.pool.get_cached_block(e.block_hash)
            if e.host_id is not None and e.block_hash is not None else None
            for e in record
        ]
        num_copies = sum(1 for e, r in zip(record, resident, strict=True)
                         if e.host_id is not None and r is None)
        num_free_resident = sum(1 for r in resident if r is not None and r.ref_cnt == 0)
        num_needed = self._blocks_for(request.num_computed_tokens + num_new_tokens)
        num_new_blocks = max(0, num_needed - len(record))
        if num_copies + num_new_blocks > self.pool.num_free_blocks - num_free_resident:
            return None
        self.pool.touch([r for r in resident if r is not None])
        blocks: list[KVCacheBlock] = []
        for entry, cached in zip(record, resident, strict=True):
            if entry.device_block is not None:
                blocks.append(entry.device_block)
            elif cached is not None:
                blocks.append(cached)
                swap.stats.swap_in_cache_hits += 1
            else:
                assert entry.host_id is not None
                (block,) = self.pool.allocate(1)
                self.transfers.copy_to_device(entry.host_id, block.block_id, swap=True)
                blocks.append(block)
        self.transfers.defer(swap.release_later(swap.host_ids(request.request_id)))
        del swap.records[request.request_id]
        new_blocks = self.pool.allocate(num_new_blocks)
        self.req_to_blocks[request.request_id] = blocks + new_blocks
        # Copied-back blocks get their hashes again after the step, like computed ones.
        self._num_cached_blocks[request.request_id] = 0
        swap.stats.swapped_in_blocks += num_copies
        return new_blocks

    def drop_swapped(self, request: Request) -> None:
        """Forget a swapped request's KV (aborted, or resumed by recompute instead)."""
        swap = self.swap
        assert swap is not None
        record = swap.records.pop(request.request_id)
        kept = [e.device_block for e in record if e.device_block is not None]
        self.pool.free(reversed(kept))
        host_ids = [e.host_id for e in record if e.host_id is not None]
        self.transfers.defer(swap.release_later(host_ids))
        self._num_cached_blocks.pop(request.request_id, None)

    # ------------------------------------------------------------------ KV imports
    def reserve(
        self, owner: str, num_blocks: int, prefix: Sequence[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """`prefix` (cached blocks, referenced, not copied) then `num_blocks` fresh blocks,
        held under `owner` (a KV import, engine.disagg) until `adopt` hands them to a
        request or `release` frees them; None if they do not fit."""
        if owner in self.req_to_blocks:
            raise ValueError(f"{owner!r} already holds blocks")
        if self.sliding is not None:
            raise ValueError("KV imports cannot fill sliding-window KV groups; start the "
                             "engine with disable_hybrid_kv_cache_manager")
        # Free prefix blocks leave the queue when touched, so they cannot also be allocated.
        num_free_prefix = sum(1 for block in prefix if block.ref_cnt == 0)
        if num_blocks > self.pool.num_free_blocks - num_free_prefix:
            return None
        self.pool.touch(prefix)
        blocks = [*prefix, *self.pool.allocate(num_blocks)]
        self.req_to_blocks[owner] = blocks
        return blocks

    def cached_blocks(self, hashes: Sequence[BlockHash]) -> list[KVCacheBlock] | None:
        """The cached blocks of these hashes, in order; None if any is not cached."""
        blocks = [self.pool.get_cached_block(block_hash) for block_hash in hashes]
        return None if any(block is None for block in blocks) else [
            block for block in blocks if block is not None
        ]

    def release(self, owner: str) -> bool:
        """Free the blocks `owner` reserved; False if it holds none (already adopted)."""
        blocks = self.req_to_blocks.pop(owner, None)
        if blocks is None:
            return False
        self.pool.free(reversed(blocks))
        return True

    def adopt(self, owner: str, request: Request) -> None:
        """Hand `owner`'s blocks to `request` (its KV for `num_computed_tokens` positions)
        and cache its full blocks under the request's own hashes."""
        self.req_to_blocks[request.request_id] = self.req_to_blocks.pop(owner)
        self._num_cached_blocks[request.request_id] = 0
        self.cache_computed_blocks(request)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The sliding groups' tables (group 1 first; 0 for released blocks); [] without."""
        return [] if self.sliding is None else self.sliding.block_ids(request_id)

    def reset_prefix_cache(self) -> bool:
        if self.transfers or (self.swap is not None and self.swap.records):
            return False
        self.pool.on_evict = None  # a reset drops blocks; it does not save them
        ok = self.pool.reset_prefix_cache()
        if self.host_tier is not None:
            self.pool.on_evict = self._offload_evicted
            if ok:
                self.host_tier.clear()
        return ok

    def take_events(self) -> KVCacheEvents:
        stored, removed = self.pool.take_events()
        if self.host_tier is None:
            return KVCacheEvents(stored=stored, removed=removed)
        stored_host, removed_host = self.host_tier.take_events()
        return KVCacheEvents(stored, removed, stored_host, removed_host)

    def check_integrity(self) -> None:
        """free + in use == total, and every in-use reference is owned by some request
        (running, or swapped out and keeping a shared block); both host pools are whole."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        owned = list(self.req_to_blocks.values())
        if self.swap is not None:
            self.swap.check_integrity()
            owned += [[e.device_block for e in rec if e.device_block is not None]
                      for rec in self.swap.records.values()]
        if self.host_tier is not None:
            self.host_tier.check_integrity()
        if self.sliding is not None:
            owned.append(list(self.sliding.owned()))
        for blocks in owned:
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
