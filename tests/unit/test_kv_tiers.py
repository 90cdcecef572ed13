"""Swap preemption and the host tier of the prefix cache, with exact ids in both pools.

Block size 4 (tests/unit/conftest.py). Host ids are laid out as the engine does: swap space
first, then the host tier. The harness takes each schedule's transfer plan (the copies the
engine runs before the step) into `h.last_plan` and checks integrity, both host pools
included, before and after.
"""

from engine.core.request import RequestStatus
from engine.kv_tiers.host_tier import HostKVTier
from engine.kv_tiers.transfer import TransferPlan


def toks(start, n):
    return list(range(start, start + n))


def test_swap_out_moves_only_unshared_blocks_and_swap_in_reuses_cached_ones(make_harness):
    h = make_harness(num_blocks=4, num_swap_blocks=4, preemption_mode="swap")
    h.add("a", toks(10, 7), max_tokens=3)
    b = h.add("b", toks(100, 7), max_tokens=8)
    c = h.add("c", toks(200, 4), max_tokens=2)
    h.step()
    h.step()
    assert (h.block_ids("a"), h.block_ids("b")) == ([0, 1], [2, 3])
    h.kv.take_events()

    # Step 3: a needs a third block; b (newer) is swapped out, not recomputed.
    out = h.schedule()
    assert out.preempted == out.swapped_out == [b]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 8
    assert h.swapped == ["b"] and h.waiting == ["c"]  # c waits: no admission after preempting
    assert h.last_plan == TransferPlan(
        to_host_device_ids=(2, 3), to_host_host_ids=(0, 1), num_swap_out=2
    )
    assert [e.host_id for e in h.kv.swap.records["b"]] == [0, 1]
    # The moved blocks stay cached on the device until reused; a's new block evicts b's last.
    assert h.block_ids("a") == [0, 1, 3]
    assert h.kv.pool.free_queue.block_ids() == [2]
    assert h.kv.take_events().removed == [b.block_hashes[1]]
    h.update(out)  # a finishes
    assert h.kv.pool.free_queue.block_ids() == [3, 2, 1, 0]

    # Step 4: b comes back before c is admitted. Block 2 still caches b's first block: reused
    # in place; the second is copied from host block 1 into block 3.
    out = h.schedule()
    assert out.swapped_in == [b]
    assert h.scheduled(out) == [("b", 1), ("c", 4)]
    assert h.block_ids("b") == [2, 3, 1]
    assert h.block_ids("c") == [0]
    assert h.last_plan == TransferPlan(
        to_device_host_ids=(1,), to_device_device_ids=(3,), num_swap_in=1
    )
    assert h.kv.swap.num_free == 4 and h.kv.swap.records == {}
    stats = h.kv.swap.stats
    assert (stats.swapped_out_blocks, stats.swapped_in_blocks, stats.swap_in_cache_hits) == (
        2, 1, 1
    )
    h.update(out)
    # The copied-back block gets its hash again once the step completed.
    assert h.kv.pool.blocks[3].block_hash == b.block_hashes[1]
    h.run_to_completion()
    assert c.num_output_tokens == 2 and b.num_output_tokens == 8
    h.assert_all_blocks_free()


def test_shared_blocks_stay_on_the_device_while_swapped(make_harness):
    h = make_harness(num_blocks=4, num_swap_blocks=4, preemption_mode="swap")
    h.add("a", toks(10, 7), max_tokens=8)
    h.step()
    b = h.add("b", toks(10, 4) + toks(100, 3), max_tokens=8)  # shares a's first block
    h.step()
    h.step()
    assert (h.block_ids("a"), h.block_ids("b")) == ([0, 1, 3], [0, 2])

    out = h.schedule()  # b needs a third block: it is the victim itself
    assert out.swapped_out == [b] and h.scheduled(out) == [("a", 1)]
    record = h.kv.swap.records["b"]
    assert record[0].device_block is h.kv.pool.blocks[0] and record[0].host_id is None
    assert record[1].host_id == 0 and record[1].block_hash == b.block_hashes[1]
    assert [blk.ref_cnt for blk in h.kv.pool.blocks] == [2, 1, 0, 1]  # b keeps block 0
    assert h.last_plan == TransferPlan(
        to_host_device_ids=(2,), to_host_host_ids=(0,), num_swap_out=1
    )
    h.update(out)
    h.run_to_completion()
    h.assert_all_blocks_free()
    assert h.kv.swap.num_free == 4


def test_swap_falls_back_to_recompute_when_swap_space_is_full(make_harness):
    h = make_harness(num_blocks=4, num_swap_blocks=1, preemption_mode="swap")
    h.add("a", toks(10, 7), max_tokens=3)
    b = h.add("b", toks(100, 7), max_tokens=8)
    h.step()
    h.step()
    out = h.schedule()
    assert out.preempted == [b] and out.swapped_out == []  # two blocks, room for one
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert h.waiting == ["b"] and h.last_plan == TransferPlan()


def test_auto_mode_swaps_only_victims_above_the_threshold(make_harness):
    h = make_harness(num_blocks=4, num_swap_blocks=4, preemption_mode="auto",
                     swap_min_computed_tokens=9)
    h.add("a", toks(10, 7), max_tokens=3)
    b = h.add("b", toks(100, 7), max_tokens=8)
    h.step()
    h.step()
    out = h.schedule()  # b has 8 computed tokens < 9: recompute
    assert out.preempted == [b] and out.swapped_out == []


def test_abort_of_a_swapped_request_frees_both_pools(make_harness):
    h = make_harness(num_blocks=4, num_swap_blocks=4, preemption_mode="swap")
    h.add("a", toks(10, 7), max_tokens=8)
    h.step()
    h.add("b", toks(10, 4) + toks(100, 3), max_tokens=8)
    h.step()
    h.step()
    h.update(h.schedule())
    assert h.swapped == ["b"]
    h.scheduler.abort_request("b")
    h.kv.transfers.take()  # the engine's next step releases the host blocks
    h.scheduler.check_integrity()
    assert h.kv.swap.num_free == 4 and h.swapped == []
    assert [blk.ref_cnt for blk in h.kv.pool.blocks] == [1, 1, 0, 1]  # only a's blocks


def test_evicted_prefix_blocks_go_to_the_host_tier_and_reload_on_a_hit(make_harness):
    h = make_harness(num_blocks=4, num_host_blocks=2)
    a = h.add("a", toks(10, 9), max_tokens=1)
    h.step()
    assert h.kv.pool.free_queue.block_ids() == [2, 3, 1, 0]
    h.kv.take_events()

    # c takes every block: a's two cached blocks are evicted, deepest first, into the tier.
    c = h.add("c", toks(500, 13), max_tokens=1)
    h.step()
    assert h.last_plan == TransferPlan(to_host_device_ids=(1, 0), to_host_host_ids=(0, 1))
    assert h.kv.host_tier.hashes() == [a.block_hashes[1], a.block_hashes[0]]
    events = h.kv.take_events()
    assert events.removed == [a.block_hashes[1], a.block_hashes[0]]
    assert events.stored_host == [a.block_hashes[1], a.block_hashes[0]]
    assert h.kv.pool.free_queue.block_ids() == [0, 1, 3, 2]

    # a's prompt again: both blocks miss on the device and hit the tier; each reloads into a
    # fresh block. Making room evicts c's blocks, but the tier's blocks are pinned by the
    # reload, so c's are dropped rather than overwrite what this step still reads.
    a2 = h.add("a2", toks(10, 9), max_tokens=1)
    out = h.schedule()
    assert h.scheduled(out) == [("a2", 1)]
    assert h.block_ids("a2") == [0, 1, 3]
    assert h.last_plan == TransferPlan(to_device_host_ids=(1, 0), to_device_device_ids=(0, 1))
    assert (a2.num_cached_tokens, a2.num_host_cached_tokens) == (8, 8)
    events = h.kv.take_events()
    assert events.removed == [c.block_hashes[2], c.block_hashes[1]]
    assert events.stored_host == events.removed_host == []
    assert (h.kv.stats.hits, h.kv.stats.host_hits) == (0, 8)
    assert h.kv.host_tier.stats.hits == 2
    h.update(out)
    # Reloaded blocks are device cache hits again once the step completed.
    assert h.kv.take_events().stored == a.block_hashes[:2]
    h.assert_all_blocks_free()


def test_host_tier_evicts_lru_and_refreshes_on_reoffload():
    tier = HostKVTier(2, offset=3)
    assert [tier.offload(h) for h in (b"x", b"y")] == [3, 4]
    assert tier.offload(b"x") is None  # already held: refreshed, no copy
    assert tier.offload(b"z") == 4  # y was least recently used
    assert tier.hashes() == [b"x", b"z"]
    tier.pin(3)
    assert tier.offload(b"w") == 4  # x is pinned, z goes
    tier.pin(4)
    assert tier.offload(b"v") is None  # everything pinned: dropped
    tier.unpin(3)
    tier.unpin(4)
    assert tier.take_events() == ([b"x", b"y", b"z", b"w"], [b"y", b"z"])
    assert tier.stats.evictions == 2
    tier.check_integrity()


def test_reset_prefix_cache_clears_the_host_tier(make_harness):
    h = make_harness(num_blocks=4, num_host_blocks=2)
    h.add("a", toks(10, 9), max_tokens=1)
    h.step()
    h.add("c", toks(500, 13), max_tokens=1)
    h.step()
    assert len(h.kv.host_tier.hashes()) == 2
    h.kv.take_events()
    assert h.kv.reset_prefix_cache()
    assert h.kv.host_tier.hashes() == [] and h.kv.host_tier.num_free == 2
    events = h.kv.take_events()
    assert len(events.removed_host) == 2 and events.stored_host == []
