"""BlockPool: allocation order, LRU free queue, caching, lazy eviction and KV events."""

import pytest

from engine.core.block_pool import BlockPool
from kvfleet.contracts.block_hash import hash_token_blocks

H = hash_token_blocks(list(range(40)), 4)  # ten distinct chained hashes


def ids(blocks):
    return [b.block_id for b in blocks]


def refs(pool):
    return [b.ref_cnt for b in pool.blocks]


def test_initial_state():
    pool = BlockPool(10, enable_caching=True)
    assert pool.num_free_blocks == 10
    assert pool.free_queue.block_ids() == list(range(10))
    assert refs(pool) == [0] * 10
    assert pool.cached == {}
    assert pool.take_events() == ([], [])
    pool.check_integrity()


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_rejects_empty_pool(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks, enable_caching=True)


def test_allocate_takes_from_the_front_in_order():
    pool = BlockPool(10, enable_caching=True)
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert ids(pool.allocate(2)) == [3, 4]
    assert refs(pool) == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert pool.free_queue.block_ids() == [5, 6, 7, 8, 9]
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4, enable_caching=True)
    pool.allocate(3)
    with pytest.raises(ValueError, match="cannot allocate 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.free_queue.block_ids() == [3]
    pool.check_integrity()


def test_free_uncached_blocks_go_to_the_front():
    pool = BlockPool(10, enable_caching=True)
    blocks = pool.allocate(3)
    pool.free(reversed(blocks))  # tail first, as the manager does
    assert pool.free_queue.block_ids() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert refs(pool) == [0] * 10
    pool.check_integrity()


def test_free_cached_blocks_go_to_the_back_tail_first():
    pool = BlockPool(10, enable_caching=True)
    blocks = pool.allocate(3)
    for block, block_hash in zip(blocks, H, strict=False):
        pool.cache_block(block, block_hash)
    pool.free(reversed(blocks))
    # The chain's tail sits nearer the front, so it is evicted before the root.
    assert pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert pool.cached == {H[0]: blocks[0], H[1]: blocks[1], H[2]: blocks[2]}
    pool.check_integrity()


def test_free_mixed_cached_and_uncached():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], H[0])
    pool.cache_block(blocks[1], H[1])  # block 2 is a partial, uncached tail
    pool.free(reversed(blocks))
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    pool.check_integrity()


def test_lru_across_requests():
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(1)
    b = pool.allocate(1)
    pool.cache_block(a[0], H[0])
    pool.cache_block(b[0], H[5])
    pool.free(a)  # freed first: least recently used
    pool.free(b)
    assert pool.free_queue.block_ids() == [2, 3, 0, 1]
    # Uncached blocks are reused before any cached one.
    assert ids(pool.allocate(2)) == [2, 3]
    assert pool.take_events() == ([H[0], H[5]], [])
    # Then the least recently freed cached block is evicted first.
    assert ids(pool.allocate(1)) == [0]
    assert pool.take_events() == ([], [H[0]])
    assert pool.get_cached_block(H[0]) is None
    assert pool.get_cached_block(H[5]) is b[0]
    pool.check_integrity()


def test_free_cached_block_keeps_hash_until_slot_is_reused():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, H[0])
    assert pool.take_events() == ([H[0]], [])
    pool.free([block])
    assert block.block_hash == H[0]
    assert pool.get_cached_block(H[0]) is block
    assert pool.take_events() == ([], [])  # freeing is not evicting
    assert ids(pool.allocate(1)) == [1]  # the uncached block goes first
    assert pool.take_events() == ([], [])
    assert ids(pool.allocate(1)) == [0]  # now the slot is reused: evicted
    assert block.block_hash is None
    assert pool.get_cached_block(H[0]) is None
    assert pool.take_events() == ([], [H[0]])
    pool.check_integrity()


def test_touch_takes_free_cached_block_out_of_the_queue():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], H[0])
    pool.cache_block(blocks[1], H[1])
    pool.free(reversed(blocks))
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    pool.take_events()
    hit = pool.get_cached_block(H[0])
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_queue.block_ids() == [2, 3, 1]
    assert hit.block_hash == H[0]
    assert pool.take_events() == ([], [])  # a hit is not an eviction
    pool.check_integrity()


def test_touch_in_use_block_only_adds_a_reference():
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, H[0])
    pool.touch([block])
    assert block.ref_cnt == 2
    assert pool.free_queue.block_ids() == [1, 2, 3]
    pool.free([block])
    assert block.ref_cnt == 1
    assert pool.free_queue.block_ids() == [1, 2, 3]
    pool.free([block])
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]
    pool.check_integrity()


def test_same_hash_twice_keeps_one_block():
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.allocate(2)
    pool.cache_block(first, H[0])
    pool.cache_block(second, H[0])
    assert pool.get_cached_block(H[0]) is first
    assert second.block_hash is None
    assert pool.take_events() == ([H[0]], [])
    pool.free([second, first])
    # The duplicate stayed uncached, so it is reused first and evicts nothing.
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]
    pool.allocate(3)
    assert pool.take_events() == ([], [])
    pool.check_integrity()


def test_cache_block_is_idempotent_for_an_already_cached_block():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, H[0])
    pool.cache_block(block, H[1])  # already holds a hash: ignored
    assert block.block_hash == H[0]
    assert pool.get_cached_block(H[1]) is None
    assert pool.take_events() == ([H[0]], [])


def test_caching_disabled_caches_nothing():
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], H[0])
    assert blocks[0].block_hash is None
    assert pool.cached == {}
    pool.free(reversed(blocks))
    assert pool.free_queue.block_ids() == [0, 1, 2]
    assert pool.take_events() == ([], [])


def test_free_more_than_allocated_raises():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="freed more times than allocated"):
        pool.free([block])
    assert pool.free_queue.block_ids() == [0, 1]
    pool.check_integrity()


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], H[0])
    pool.cache_block(blocks[1], H[1])
    pool.free([blocks[1]])
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.cached == {H[0]: blocks[0], H[1]: blocks[1]}
    assert pool.take_events() == ([], [])
    pool.free([blocks[0]])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert sorted(pool.take_events()[1]) == sorted([H[0], H[1]])
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_take_events_drains():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, H[3])
    assert pool.take_events() == ([H[3]], [])
    assert pool.take_events() == ([], [])


def test_check_integrity_detects_ref_cnt_disagreement():
    pool = BlockPool(3, enable_caching=True)
    pool.allocate(1)
    pool.blocks[0].ref_cnt = 0  # in use per queue, free per ref count
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_detects_wrong_cache_index():
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache_block(block, H[0])
    pool.cached[H[1]] = block
    with pytest.raises(AssertionError):
        pool.check_integrity()
