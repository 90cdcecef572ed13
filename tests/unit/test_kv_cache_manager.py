"""KVCacheManager on tiny configs: exact block ids, ref counts, free-queue order and events.

Style follows vLLM's tests/v1/core/test_prefix_caching.py.
"""

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from kvfleet.contracts.sampling_params import SamplingParams

BS = 4


def make_request(rid, tokens, seq=0, **kwargs):
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=16),
        max_tokens=16,
        block_size=BS,
        arrival_seq=seq,
        **kwargs,
    )


def ids(blocks):
    return [b.block_id for b in blocks]


def refs(manager):
    return [b.ref_cnt for b in manager.pool.blocks]


def free_ids(manager):
    return manager.pool.free_queue.block_ids()


def admit(manager, request):
    """What the scheduler does on admission: look up hits, allocate the rest, and (once the
    step has completed) cache the computed blocks."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)
    manager.check_integrity()
    return hits, new


@pytest.fixture
def manager():
    return KVCacheManager(num_blocks=10, block_size=BS)


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(1, [0]), (3, [0]), (4, [0]), (5, [0, 1]), (8, [0, 1]), (12, [0, 1, 2]), (13, [0, 1, 2, 3])],
)
def test_allocate_gives_ceil_n_over_block_size_blocks(manager, num_tokens, expected):
    request = make_request("a", range(num_tokens))
    new = manager.allocate_slots(request, num_tokens)
    assert ids(new) == expected
    assert manager.get_block_ids("a") == expected
    assert free_ids(manager) == list(range(len(expected), 10))
    manager.check_integrity()


def test_growth_by_one_token_crossing_a_block_boundary(manager):
    request = make_request("a", range(8))
    assert ids(manager.allocate_slots(request, 8)) == [0, 1]
    request.num_computed_tokens = 8
    request.append_output_token(100)  # token 8 starts block 2
    assert ids(manager.allocate_slots(request, 1)) == [2]
    request.num_computed_tokens = 9
    for step in range(3):  # tokens 9, 10, 11 fit in block 2
        request.append_output_token(101 + step)
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    request.append_output_token(200)  # token 12 starts block 3
    assert ids(manager.allocate_slots(request, 1)) == [3]
    assert manager.get_block_ids("a") == [0, 1, 2, 3]
    manager.check_integrity()


@pytest.mark.parametrize(("prompt_len", "num_hit_tokens"), [(12, 8), (13, 12), (4, 0), (5, 4)])
def test_prefix_hit_never_includes_the_last_token(manager, prompt_len, num_hit_tokens):
    first = make_request("a", range(prompt_len))
    admit(manager, first)
    second = make_request("b", range(prompt_len), seq=1)
    hits, num_hits = manager.get_computed_blocks(second)
    assert num_hits == num_hit_tokens
    assert ids(hits) == list(range(num_hit_tokens // BS))


def test_repeated_prompt_shares_blocks(manager):
    a = make_request("a", range(12))
    _, new_a = admit(manager, a)
    assert ids(new_a) == [0, 1, 2]
    assert manager.take_events().stored == a.block_hashes
    b = make_request("b", range(12), seq=1)
    hits, new_b = admit(manager, b)
    assert ids(hits) == [0, 1]
    assert ids(new_b) == [3]
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert refs(manager) == [2, 2, 1, 1, 0, 0, 0, 0, 0, 0]
    # b's last block duplicates a's block 2: it stays uncached, one block per hash.
    assert manager.pool.get_cached_block(a.block_hashes[2]).block_id == 2
    assert manager.pool.blocks[3].block_hash is None
    assert manager.take_events().stored == []
    manager.free(b)
    assert refs(manager) == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert free_ids(manager) == [3, 4, 5, 6, 7, 8, 9]
    manager.check_integrity()


def test_hit_on_freed_cached_blocks_takes_them_out_of_the_queue(manager):
    a = make_request("a", range(12))
    admit(manager, a)
    manager.free(a)
    assert free_ids(manager) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    manager.take_events()
    b = make_request("b", range(13), seq=1)
    hits, new = admit(manager, b)
    assert ids(hits) == [0, 1, 2]
    assert ids(new) == [3]
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9]
    assert refs(manager)[:4] == [1, 1, 1, 1]
    assert manager.take_events().removed == []


def test_own_hits_are_not_evicted_to_make_room():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    prefix = list(range(8))
    a = make_request("a", prefix)
    admit(manager, a)  # blocks 0, 1 cached
    manager.free(a)
    c = make_request("c", range(50, 58), seq=1)
    admit(manager, c)  # uncached 2, 3 first
    manager.free(c)
    # a's blocks are least recently used: at the front of the queue.
    assert free_ids(manager) == [1, 0, 3, 2]
    manager.take_events()
    b = make_request("b", prefix + list(range(90, 98)), seq=2)
    hits, new = admit(manager, b)
    assert ids(hits) == [0, 1]
    assert ids(new) == [3, 2]  # c's blocks are evicted, never b's own hits
    assert manager.get_block_ids("b") == [0, 1, 3, 2]
    assert free_ids(manager) == []
    events = manager.take_events()
    assert events.removed == [c.block_hashes[1], c.block_hashes[0]]
    assert events.stored == b.block_hashes[2:4]


def test_allocation_failure_returns_none_and_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", range(12))
    admit(manager, a)
    manager.take_events()
    b = make_request("b", range(50, 58), seq=1)
    assert manager.allocate_slots(b, 8) is None
    assert "b" not in manager.req_to_blocks
    assert manager.get_block_ids("b") == []
    assert free_ids(manager) == [3]
    assert refs(manager) == [1, 1, 1, 0]
    # A running request that cannot grow keeps exactly what it had.
    a.append_output_token(7)
    for token in range(4):
        a.append_output_token(token)
    assert manager.allocate_slots(a, 5) is None
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.take_events().stored == []
    manager.check_integrity()


def test_allocation_failure_with_hits_does_not_touch_them():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", range(8))
    admit(manager, a)
    manager.free(a)
    holder = make_request("holder", range(50, 58), seq=1)
    admit(manager, holder)  # holds 2, 3
    assert free_ids(manager) == [1, 0]
    manager.take_events()
    b = make_request("b", list(range(8)) + list(range(60, 72)), seq=2)
    hits, num_hits = manager.get_computed_blocks(b)
    assert (ids(hits), num_hits) == ([0, 1], 8)
    assert manager.allocate_slots(b, b.num_tokens - num_hits, hits) is None
    assert free_ids(manager) == [1, 0]
    assert refs(manager) == [0, 0, 1, 1]
    assert manager.pool.get_cached_block(a.block_hashes[0]).block_id == 0
    assert "b" not in manager.req_to_blocks
    events = manager.take_events()
    assert (events.stored, events.removed) == ([], [])
    manager.check_integrity()


def test_exact_fit_with_free_hits_succeeds():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", range(12))
    admit(manager, a)
    manager.free(a)
    b = make_request("b", range(13), seq=1)  # 3 hits + 1 new block = the whole pool
    hits, new = admit(manager, b)
    assert (ids(hits), ids(new)) == ([0, 1, 2], [3])
    assert manager.num_free_blocks == 0


def test_salt_isolates_tenants(manager):
    a = make_request("a", range(12), cache_salt="tenant-x")
    admit(manager, a)
    assert manager.get_computed_blocks(make_request("b", range(12), cache_salt="tenant-y"))[1] == 0
    assert manager.get_computed_blocks(make_request("c", range(12)))[1] == 0
    hits, num = manager.get_computed_blocks(make_request("d", range(12), cache_salt="tenant-x"))
    assert (ids(hits), num) == ([0, 1], 8)


def test_lora_isolates_adapters(manager):
    admit(manager, make_request("a", range(12), lora_id="l1"))
    assert manager.get_computed_blocks(make_request("b", range(12), lora_id="l2"))[1] == 0
    assert manager.get_computed_blocks(make_request("c", range(12)))[1] == 0
    assert manager.get_computed_blocks(make_request("d", range(12), lora_id="l1"))[1] == 8


def test_partial_prefix_hit_stops_at_first_miss(manager):
    admit(manager, make_request("a", range(12)))
    b = make_request("b", [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12], seq=1)
    hits, num = manager.get_computed_blocks(b)
    assert (ids(hits), num) == ([0], 4)


def test_events_stored_and_removed_in_order(manager):
    a = make_request("a", range(12))
    admit(manager, a)
    assert manager.take_events().stored == a.block_hashes
    manager.free(a)
    assert manager.take_events().removed == []  # freeing evicts nothing
    big = make_request("big", range(100, 140), seq=1)  # needs all 10 blocks
    _, new = admit(manager, big)
    assert ids(new) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    events = manager.take_events()
    assert events.removed == [a.block_hashes[2], a.block_hashes[1], a.block_hashes[0]]
    assert events.stored == big.block_hashes
    assert manager.take_events().stored == []


def test_chunked_allocation_caches_only_full_computed_blocks(manager):
    request = make_request("a", range(10))
    assert ids(manager.allocate_slots(request, 6)) == [0, 1]
    assert manager.take_events().stored == []  # allocated, KV not written yet
    request.num_computed_tokens = 6
    manager.cache_computed_blocks(request)
    assert manager.take_events().stored == request.block_hashes[:1]
    assert ids(manager.allocate_slots(request, 4)) == [2]
    assert manager.take_events().stored == []
    request.num_computed_tokens = 10
    manager.cache_computed_blocks(request)
    assert manager.take_events().stored == request.block_hashes[1:2]
    manager.check_integrity()


def test_block_filled_by_output_is_cached_once_computed(manager):
    request = make_request("a", range(7))
    manager.allocate_slots(request, 7)
    request.num_computed_tokens = 7
    manager.cache_computed_blocks(request)
    assert manager.take_events().stored == request.block_hashes[:1]
    request.append_output_token(42)  # block 1 full: hash known, KV not yet computed
    assert len(request.block_hashes) == 2
    manager.allocate_slots(request, 1)
    manager.cache_computed_blocks(request)
    assert manager.pool.get_cached_block(request.block_hashes[1]) is None
    assert manager.take_events().stored == []
    request.num_computed_tokens = 8
    manager.cache_computed_blocks(request)
    assert manager.take_events().stored == [request.block_hashes[1]]


def test_allocated_but_never_computed_blocks_are_never_hits(manager):
    """A step that failed after allocation leaves no hash behind (no poisoned cache)."""
    a = make_request("a", range(12))
    assert ids(manager.allocate_slots(a, 12)) == [0, 1, 2]
    # The step raised: num_computed_tokens never advanced, the request is aborted.
    manager.free(a)
    assert manager.take_events().stored == []
    assert free_ids(manager) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # uncached: reused first
    assert manager.get_computed_blocks(make_request("b", range(12), seq=1)) == ([], 0)
    assert all(block.block_hash is None for block in manager.pool.blocks)
    manager.check_integrity()


def test_reset_prefix_cache(manager):
    a = make_request("a", range(12))
    admit(manager, a)
    manager.take_events()
    assert manager.reset_prefix_cache() is False
    assert manager.take_events().removed == []
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert sorted(manager.take_events().removed) == sorted(a.block_hashes)
    assert manager.get_computed_blocks(make_request("b", range(12), seq=1)) == ([], 0)
    manager.check_integrity()


def test_caching_disabled_never_hits():
    manager = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = make_request("a", range(12))
    admit(manager, a)
    assert manager.get_computed_blocks(make_request("b", range(12), seq=1)) == ([], 0)
    manager.free(a)
    assert free_ids(manager) == list(range(10))
    assert manager.take_events().stored == []


def test_free_returns_every_block(manager):
    requests = [make_request(f"r{i}", range(i * 20, i * 20 + 5 + i), seq=i) for i in range(3)]
    for request in requests:
        admit(manager, request)
    shared = make_request("shared", range(0, 9), seq=9)  # hits r0's first block
    admit(manager, shared)
    assert manager.num_free_blocks < 10
    for request in [*requests, shared]:
        manager.free(request)
        manager.check_integrity()
    assert manager.num_free_blocks == 10
    assert sorted(free_ids(manager)) == list(range(10))
    assert refs(manager) == [0] * 10
    assert manager.req_to_blocks == {}
    assert manager.usage == 0.0


def test_free_unknown_request_is_a_no_op(manager):
    manager.free(make_request("ghost", range(3)))
    assert manager.num_free_blocks == 10


def test_usage_and_can_fit(manager):
    admit(manager, make_request("a", range(12)))
    assert manager.usage == pytest.approx(0.3)
    assert manager.can_fit(40)
    assert not manager.can_fit(41)


def test_check_integrity_detects_orphan_reference(manager):
    admit(manager, make_request("a", range(8)))
    manager.pool.blocks[0].ref_cnt += 1  # a reference no request owns
    with pytest.raises(AssertionError):
        manager.check_integrity()
