"""Preemption by recompute when blocks run out: victim choice, requeueing, resumption.

Block size 4 and a 4-block pool: two 7-token prompts fill it, and both need a third block when
their 9th token (position 8) is scheduled, in the third step.
"""

from engine.core.request import RequestStatus


def toks(start, n):
    return list(range(start, start + n))


def fill_pool(h, first_priority=0, second_priority=0, third_priority=0):
    a = h.add("a", toks(10, 7), max_tokens=3, priority=first_priority)
    b = h.add("b", toks(100, 7), max_tokens=8, priority=second_priority)
    c = h.add("c", toks(200, 4), max_tokens=2, priority=third_priority)
    return a, b, c


def test_preemption_evicts_newest_requeues_by_arrival_and_resumes_from_cache(make_harness):
    h = make_harness(num_blocks=4)
    a, b, c = fill_pool(h)

    out, _ = h.step()
    assert h.scheduled(out) == [("a", 7), ("b", 7)]  # c cannot get a block
    assert (h.block_ids("a"), h.block_ids("b")) == ([0, 1], [2, 3])
    assert h.waiting == ["c"]
    out, _ = h.step()
    assert h.scheduled(out) == [("a", 1), ("b", 1)]
    assert out.preempted == []
    events = h.kv.take_events()
    assert events.stored == [
        a.block_hashes[0],
        b.block_hashes[0],
        a.block_hashes[1],
        b.block_hashes[1],
    ]

    # Step 3: a needs a third block; b (same priority, newer) is preempted by recompute.
    out = h.schedule()
    assert out.preempted == [b]
    assert h.scheduled(out) == [("a", 1)]  # c is not admitted in a step that preempted
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert h.scheduler.num_preemptions == 1
    assert b.output_token_ids == [500, 500]  # kept; recomputed on resumption
    assert h.block_ids("b") == []
    assert h.waiting == ["b", "c"]  # back at its arrival position, ahead of c
    assert h.running == ["a"]
    # b's blocks went back tail first; a's new block evicted b's deepest one.
    assert h.block_ids("a") == [0, 1, 3]
    assert h.kv.pool.free_queue.block_ids() == [2]
    assert h.kv.take_events().removed == [b.block_hashes[1]]

    updates = h.update(out)
    assert [(u.request.request_id, u.finished) for u in updates] == [("a", True)]
    assert h.kv.pool.free_queue.block_ids() == [3, 2, 1, 0]

    # Step 4: b resumes and re-uses its still-cached first block; c follows.
    out, _ = h.step()
    assert h.scheduled(out) == [("b", 5), ("c", 4)]
    assert h.block_ids("b") == [2, 3, 1]
    assert h.block_ids("c") == [0]
    assert b.status == RequestStatus.RUNNING
    assert b.num_cached_tokens == 0  # recorded on first admission only
    assert b.num_computed_tokens == 9
    assert b.num_output_tokens == 3
    events = h.kv.take_events()
    assert events.removed == [a.block_hashes[1], a.block_hashes[0]]
    assert events.stored == [b.block_hashes[1], c.block_hashes[0]]

    h.run_to_completion()
    assert b.num_output_tokens == 8 and b.status == RequestStatus.FINISHED_LENGTH
    assert b.num_preemptions == 1
    h.assert_all_blocks_free()


def test_preemption_picks_lowest_priority_before_newest(make_harness):
    h = make_harness(num_blocks=4)
    a, b, _ = fill_pool(h, first_priority=1, second_priority=0, third_priority=2)
    out, _ = h.step()
    assert h.scheduled(out) == [("b", 7), ("a", 7)]
    assert (h.block_ids("b"), h.block_ids("a")) == ([0, 1], [2, 3])
    h.step()
    out, _ = h.step()
    # a is older but has the lower priority: a is the victim.
    assert out.preempted == [a]
    assert h.scheduled(out) == [("b", 1)]
    assert a.status == RequestStatus.PREEMPTED and b.status == RequestStatus.RUNNING
    assert h.waiting == ["a", "c"]  # a (priority 1) sorts before c (priority 2)
    assert h.block_ids("b") == [0, 1, 3]


def test_no_waiting_request_is_admitted_in_a_step_that_preempted(make_harness):
    h = make_harness(num_blocks=4)
    h.add("a", toks(10, 7), max_tokens=3)
    b = h.add("b", toks(100, 7), max_tokens=8, priority=1)
    h.step()
    h.step()
    h.add("c", toks(200, 4))  # priority 0: sorts ahead of b once b is requeued
    out = h.schedule()
    assert out.preempted == [b]
    assert h.waiting == ["c", "b"]
    assert h.kv.num_free_blocks == 1  # enough for c, but c must wait a step
    assert h.scheduled(out) == [("a", 1)]
    h.update(out)
    out, _ = h.step()
    assert h.scheduled(out) == [("c", 4), ("b", 5)]
    assert (h.block_ids("c"), h.block_ids("b")) == ([3], [2, 1, 0])


def test_preemption_takes_the_unscheduled_tail_only(make_harness):
    h = make_harness(num_blocks=6, max_num_batched_tokens=32)
    a = h.add("a", toks(10, 7), max_tokens=3)
    b = h.add("b", toks(20, 7), max_tokens=3)
    c = h.add("c", toks(30, 7), max_tokens=3)
    assert h.scheduled(h.step()[0]) == [("a", 7), ("b", 7), ("c", 7)]
    h.step()
    h.kv.take_events()
    out = h.schedule()
    # a's growth preempts c; the blocks c freed then serve b as well.
    assert out.preempted == [c]
    assert h.scheduled(out) == [("a", 1), ("b", 1)]
    assert (h.block_ids("a"), h.block_ids("b")) == ([0, 1, 5], [2, 3, 4])
    assert h.kv.take_events().removed == [c.block_hashes[1], c.block_hashes[0]]
    h.update(out)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    out, _ = h.step()
    assert h.scheduled(out) == [("c", 9)]  # nothing left in the cache: full recompute
    h.run_to_completion()
    assert c.num_output_tokens == 3
    h.assert_all_blocks_free()


def test_two_victims_in_one_step(make_harness):
    h = make_harness(num_blocks=3)
    h.add("a", toks(10, 4), max_tokens=8)
    b = h.add("b", toks(20, 3), max_tokens=8)
    c = h.add("c", toks(30, 3), max_tokens=8)
    assert h.scheduled(h.step()[0]) == [("a", 4), ("b", 3), ("c", 3)]
    # a's 5th token needs a second block: c is preempted (freeing one block), a takes it.
    out, _ = h.step()
    assert out.preempted == [c]
    assert h.scheduled(out) == [("a", 1), ("b", 1)]
    assert h.block_ids("a") == [0, 2]
    # b's 5th token needs a block too; only a is ahead of it, so b preempts itself.
    out, _ = h.step()
    assert out.preempted == [b]
    assert h.scheduled(out) == [("a", 1)]
    assert h.waiting == ["b", "c"]
    assert (b.num_preemptions, c.num_preemptions, h.scheduler.num_preemptions) == (1, 1, 2)


def test_self_preemption_when_the_only_running_request_cannot_grow(make_harness):
    h = make_harness(num_blocks=2)
    a = h.add("a", toks(10, 7), max_tokens=8)
    h.step()
    h.step()
    out = h.schedule()
    assert out.preempted == [a]
    assert out.scheduled == []
    assert h.waiting == ["a"] and h.running == []
    assert a.num_computed_tokens == 0
    h.update(out)
    assert a.num_output_tokens == 2
    h.assert_all_blocks_free()


def test_abort_of_a_preempted_request(make_harness):
    h = make_harness(num_blocks=4)
    _, b, _ = fill_pool(h)
    for _ in range(3):
        h.step()
    assert b.status == RequestStatus.PREEMPTED
    assert h.scheduler.abort_request("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert "b" not in h.waiting
    h.scheduler.check_integrity()
    h.run_to_completion()
    h.assert_all_blocks_free()


def test_repeated_preemption_still_completes(make_harness):
    h = make_harness(num_blocks=5, max_num_batched_tokens=8)
    reqs = [h.add(f"r{i}", toks(20 * i, 5), max_tokens=10) for i in range(4)]
    steps = h.run_to_completion()
    assert steps < 200
    assert all(r.num_output_tokens == 10 for r in reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert h.scheduler.num_preemptions == sum(r.num_preemptions for r in reqs) > 0
    h.assert_all_blocks_free()
