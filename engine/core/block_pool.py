"""KV cache blocks, the free-block queue and the block pool.

Invariants:
- Every block is either in use (ref_cnt > 0, not in the free queue) or free (ref_cnt == 0, in
  the free queue exactly once). `num_free_blocks + num_used_blocks == num_blocks` always.
- Free blocks without a hash sit at the front (reused first); freed cached blocks go to the
  back, so cached blocks are evicted in LRU order.
- A cached block keeps its hash while free; it is evicted (hash dropped, `removed` event) only
  when its slot is handed out again. A prefix hit on a free cached block takes it back out of the
  queue (`touch`).
- At most one block is registered per hash.
- `on_evict`, when set (the host tier), sees every eviction of a registered block before its
  hash is dropped, while the slot still holds the block's KV.
- Blocks cached with `publish=False` (sliding-window groups, engine.core.sliding_blocks) are
  hits like any other but appear in no stored/removed event and never reach `on_evict`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvfleet.contracts.block_hash import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free-block queue; None when the block is not queued.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) remove, push-front and push-back."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels avoid special cases at both ends.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert anchor is not None and anchor.next_free is not None
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        nxt = anchor.next_free
        anchor.next_free = block
        block.prev_free = anchor
        block.next_free = nxt
        nxt.prev_free = block
        self._len += 1

    def block_ids(self) -> list[int]:
        """Queue order, front first (for tests and integrity checks)."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """Owns every block; hands out, takes back and caches them, recording KV events."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # Hashes stored / removed since the last `take_events`, in order.
        self.stored_events: list[BlockHash] = []
        self.removed_events: list[BlockHash] = []
        self.on_evict: Callable[[KVCacheBlock, BlockHash], None] | None = None
        self._unpublished: set[BlockHash] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        allocated = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the queue.

        Callers pass a request's blocks tail first, so the deepest (least shareable) blocks of a
        chain are evicted before its root.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more times than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(
        self, block: KVCacheBlock, block_hash: BlockHash, publish: bool = True
    ) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            # Another block already holds this content; this one stays uncached.
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if publish:
            self.stored_events.append(block_hash)
        else:
            self._unpublished.add(block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            published = block.block_hash not in self._unpublished
            if published and self.on_evict is not None:
                self.on_evict(block, block.block_hash)
            del self.cached[block.block_hash]
            if published:
                self.removed_events.append(block.block_hash)
            else:
                self._unpublished.discard(block.block_hash)
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        stored, removed = self.stored_events, self.removed_events
        self.stored_events, self.removed_events = [], []
        return stored, removed

    def check_integrity(self) -> None:
        queued = self.free_queue.block_ids()
        if len(queued) != len(set(queued)) or len(queued) != self.num_free_blocks:
            raise AssertionError("free queue is corrupt")
        free_set = set(queued)
        for block in self.blocks:
            if (block.ref_cnt == 0) != (block.block_id in free_set):
                raise AssertionError(f"{block} ref_cnt disagrees with the free queue")
            if block.ref_cnt < 0:
                raise AssertionError(f"{block} has a negative ref_cnt")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"{block} is indexed under a hash it does not hold")
