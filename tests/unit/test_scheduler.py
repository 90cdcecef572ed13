"""Scheduler basics on tiny configs: token budget, queue order, max_num_seqs, chunked prefill.

Every step goes through the `Harness` (conftest.py), which calls check_integrity() after
schedule() and after update_from_output().
"""

import pytest

from engine.core.request import RequestStatus


def toks(start, n):
    """n distinct prompt tokens, so requests share no prefix unless a test wants them to."""
    return list(range(start, start + n))


def test_token_budget_respected_running_first_then_waiting(make_harness):
    h = make_harness(max_num_batched_tokens=10)
    a = h.add("a", toks(10, 6))
    b = h.add("b", toks(20, 6))
    c = h.add("c", toks(30, 6))

    out, updates = h.step()
    assert h.scheduled(out) == [("a", 6), ("b", 4)]  # b gets the budget left over
    assert [u.request.request_id for u in updates] == ["a"]  # b's chunk does not sample
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (6, 4, 0)
    assert h.running == ["a", "b"]
    assert h.waiting == ["c"]
    assert (h.block_ids("a"), h.block_ids("b"), h.block_ids("c")) == ([0, 1], [2], [])

    out, updates = h.step()
    assert h.scheduled(out) == [("a", 1), ("b", 2), ("c", 6)]
    assert [u.request.request_id for u in updates] == ["a", "b", "c"]
    assert out.total_num_scheduled_tokens == 9
    assert h.running == ["a", "b", "c"]
    assert h.waiting == []
    assert (h.block_ids("a"), h.block_ids("b"), h.block_ids("c")) == ([0, 1], [2, 3], [4, 5])
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (7, 6, 6)
    assert (a.num_tokens, b.num_tokens, c.num_tokens) == (8, 7, 7)


def test_budget_exhausted_by_running_requests_admits_nobody(make_harness):
    h = make_harness(max_num_batched_tokens=2)
    h.add("a", [1])
    h.add("b", [2])
    h.step()
    assert h.running == ["a", "b"]
    h.add("c", [3])
    out, _ = h.step()
    assert h.scheduled(out) == [("a", 1), ("b", 1)]
    assert h.waiting == ["c"]


def test_max_num_seqs_respected(make_harness):
    h = make_harness(max_num_seqs=2)
    h.add("a", toks(10, 4), max_tokens=1)
    h.add("b", toks(20, 4))
    h.add("c", toks(30, 4))
    out, updates = h.step()
    assert h.scheduled(out) == [("a", 4), ("b", 4)]
    assert h.waiting == ["c"]
    # a finishes this step (max_tokens=1), so c starts in the next one.
    assert [u.finished for u in updates] == [True, False]
    assert h.running == ["b"]
    out, _ = h.step()
    assert h.scheduled(out) == [("b", 1), ("c", 4)]
    assert h.running == ["b", "c"]


def test_chunked_prefill_splits_a_long_prompt(make_harness):
    h = make_harness(max_num_batched_tokens=4)
    a = h.add("a", toks(10, 10), max_tokens=2)
    expected = [
        # (num_new_tokens, samples, num_computed after, outputs after, block ids after)
        (4, False, 4, 0, [0]),
        (4, False, 8, 0, [0, 1]),
        (2, True, 10, 1, [0, 1, 2]),
        (1, True, 11, 2, []),  # second output reaches max_tokens: finished and freed
    ]
    for num_new, samples, computed, outputs, blocks in expected:
        out = h.schedule()
        assert h.scheduled(out) == [("a", num_new)]
        assert out.scheduled[0].samples is samples
        updates = h.update(out)
        assert len(updates) == int(samples)
        assert a.num_computed_tokens == computed
        assert a.num_output_tokens == outputs
        assert h.block_ids("a") == blocks
    assert a.status == RequestStatus.FINISHED_LENGTH
    h.assert_all_blocks_free()


def test_chunked_prefill_shares_the_budget_with_a_second_prompt(make_harness):
    h = make_harness(max_num_batched_tokens=4)
    h.add("a", toks(10, 10))
    h.add("b", toks(30, 3))
    steps = [h.scheduled(h.step()[0]) for _ in range(4)]
    assert steps == [
        [("a", 4)],
        [("a", 4)],
        [("a", 2), ("b", 2)],
        [("a", 1), ("b", 1)],
    ]


def test_chunked_prefill_disabled_keeps_a_too_long_prompt_waiting(make_harness):
    h = make_harness(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = h.add("a", toks(10, 10))
    for _ in range(3):
        out, _ = h.step()
        assert out.scheduled == []
        assert h.waiting == ["a"]
        assert a.num_computed_tokens == 0
        assert a.status == RequestStatus.WAITING
    h.assert_all_blocks_free()


def test_chunked_prefill_disabled_schedules_a_prompt_whole_or_not_at_all(make_harness):
    h = make_harness(max_num_batched_tokens=8, enable_chunked_prefill=False)
    h.add("a", toks(10, 4), max_tokens=3)
    h.add("b", toks(20, 8))
    assert h.scheduled(h.step()[0]) == [("a", 4)]  # 4 left: b's 8 do not fit
    assert h.scheduled(h.step()[0]) == [("a", 1)]  # 7 left: still not
    assert h.scheduled(h.step()[0]) == [("a", 1)]  # a finishes here
    assert h.scheduled(h.step()[0]) == [("b", 8)]
    assert h.running == ["b"]


def test_priority_then_fcfs_in_the_waiting_queue(make_harness):
    h = make_harness(max_num_seqs=2)
    h.add("c", toks(10, 4), priority=1)
    h.add("a", toks(20, 4), priority=0)
    h.add("b", toks(30, 4), priority=0)
    h.add("d", toks(40, 4), priority=1)
    h.add("e", toks(50, 4), priority=-1)
    assert h.waiting == ["e", "a", "b", "c", "d"]
    out, _ = h.step()
    assert h.scheduled(out) == [("e", 4), ("a", 4)]
    assert h.waiting == ["b", "c", "d"]


def test_running_requests_are_served_in_priority_order(make_harness):
    h = make_harness(max_num_batched_tokens=16)
    h.add("low", toks(10, 4), priority=2)
    h.step()
    h.add("high", toks(20, 4), priority=0)
    out, _ = h.step()
    assert h.scheduled(out) == [("low", 1), ("high", 4)]  # running first, then admission
    out, _ = h.step()
    assert h.scheduled(out) == [("high", 1), ("low", 1)]
    assert h.running == ["high", "low"]


def test_finished_request_frees_blocks_at_once_and_waiting_starts_next_step(make_harness):
    h = make_harness(num_blocks=2)
    a = h.add("a", toks(10, 7), max_tokens=1)
    b = h.add("b", toks(20, 4))
    out, updates = h.step()
    assert h.scheduled(out) == [("a", 7)]  # b cannot get a block
    assert h.waiting == ["b"]
    assert updates[0].finished and updates[0].new_token_ids == [500]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.status.finish_reason == "length"
    # Freed before the next schedule() call.
    assert h.kv.num_free_blocks == 2
    assert h.running == []
    assert "a" not in h.scheduler.requests
    out, _ = h.step()
    assert h.scheduled(out) == [("b", 4)]
    assert b.status == RequestStatus.RUNNING


def test_prefix_hit_on_admission_skips_cached_tokens(make_harness):
    h = make_harness()
    a = h.add("a", toks(10, 12), max_tokens=1)
    h.step()
    assert a.num_cached_tokens == 0
    b = h.add("b", toks(10, 13))
    out, _ = h.step()
    assert h.scheduled(out) == [("b", 1)]  # 12 tokens hit, the last one is computed
    assert b.num_cached_tokens == 12
    assert h.block_ids("b") == [0, 1, 2, 3]
    assert h.kv.stats.queries == 12 + 13
    assert h.kv.stats.hits == 12


def test_same_step_duplicate_prompt_waits_one_step_then_shares_blocks(make_harness):
    h = make_harness()
    h.add("a", toks(10, 12))
    h.add("b", toks(10, 12))
    h.add("c", toks(50, 3))
    out, _ = h.step()
    # a's blocks become hits only once the step writing their KV completes; b, whose first
    # block a is computing, waits one step (keeping its place) rather than compute it twice.
    # c, behind it, is admitted.
    assert h.scheduled(out) == [("a", 12), ("c", 3)]
    assert h.waiting == ["b"]
    assert h.kv.stats.hits == 0
    out, _ = h.step()
    assert h.scheduled(out) == [("a", 1), ("c", 1), ("b", 4)]
    assert h.block_ids("a") == [0, 1, 2, 4]
    assert h.block_ids("b")[:2] == [0, 1]
    assert [blk.ref_cnt for blk in h.kv.pool.blocks[:2]] == [2, 2]
    assert h.kv.stats.hits == 8


def test_failed_step_leaves_no_hits(make_harness):
    """The scheduler registers blocks only in update_from_output: a step whose results never
    arrive (the model raised) leaves nothing cached for the next admission."""
    h = make_harness()
    h.add("a", toks(10, 12))
    h.schedule()  # the model then raised: no update_from_output
    h.scheduler.abort_request("a")
    assert h.kv.pool.cached == {}
    h.add("b", toks(10, 12))
    out, _ = h.step()
    assert h.scheduled(out) == [("b", 12)]
    assert h.kv.stats.hits == 0


def test_duplicate_request_id_rejected(make_harness):
    h = make_harness()
    h.add("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already in use"):
        h.add("a", [4, 5, 6])
    assert h.waiting == ["a"]


def test_request_id_reusable_after_finish(make_harness):
    h = make_harness()
    h.add("a", [1, 2, 3], max_tokens=1)
    h.step()
    assert not h.scheduler.has_unfinished_requests()
    h.add("a", [1, 2, 3], max_tokens=1)
    h.run_to_completion()
    h.assert_all_blocks_free()


def test_all_blocks_free_after_every_request_finishes(make_harness):
    h = make_harness(num_blocks=10, max_num_batched_tokens=8)
    for i in range(6):
        h.add(f"r{i}", toks(10 * i, 3 + i), max_tokens=2 + i)
    h.run_to_completion()
    assert h.scheduler.requests == {}
    h.assert_all_blocks_free()
    assert sorted(h.kv.pool.free_queue.block_ids()) == list(range(10))
