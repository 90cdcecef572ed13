"""The scheduler's half of an urgent step (engine.core.urgent_schedule) on tiny configs.

Block size 4, token budget 8. A "paused" step is one scheduled and not yet updated: the urgent
step is scheduled and updated in between, as the engine does when it pauses a forward pass
between layers; the paused step's update comes after. Exact orders and blocks are spelled out.
"""

import pytest

from engine.core.request import TenantShare
from engine.core.urgent_schedule import schedule_urgent


def toks(start, n):
    return list(range(start, start + n))


A, B = TenantShare("A"), TenantShare("B")


def urgent(h, requests, paused):
    out = schedule_urgent(h.scheduler, requests, paused)
    h.scheduler.check_integrity()
    return out


def test_urgent_step_schedules_only_the_new_tenant_and_leaves_the_paused_step_intact(
    make_harness,
):
    h = make_harness(max_num_batched_tokens=8, num_blocks=40, fair_share=True)
    h.add("a1", toks(10, 24), share=A)
    h.add("a2", toks(40, 24), share=A)
    h.step()  # a1's first chunk
    paused = h.schedule()
    assert h.scheduled(paused) == [("a1", 8)]
    a1_blocks = h.block_ids("a1")
    assert a1_blocks == [0, 1, 2, 3]
    b1 = h.add("b1", toks(80, 6), share=B)
    out = urgent(h, [b1], paused)
    assert h.scheduled(out) == [("b1", 6)]
    assert h.block_ids("b1") == [4, 5]
    assert h.waiting == ["a2"]  # the urgent step admits nobody else
    assert h.running == ["a1", "b1"]
    assert h.block_ids("a1") == a1_blocks
    # B was lifted to A's 16 on arrival, then charged its 6.
    assert h.scheduler.fair_share.counters == {"A": 16.0, "B": 22.0}
    updates = h.update(out)
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("b1", [500])]
    h.update(paused)  # the paused step resumes and completes as scheduled
    assert h.scheduler.requests["a1"].num_computed_tokens == 16
    # The next ordinary step is the scheduler's as ever: a1's prompt gives way to no one (b1
    # only decodes, a2 is A's own) and spends the budget in running order.
    out, _ = h.step()
    assert h.scheduled(out) == [("a1", 8)]
    h.run_to_completion()
    h.assert_all_blocks_free()


def test_a_prompt_longer_than_the_budget_gets_one_chunk_and_continues_in_ordinary_steps(
    make_harness,
):
    h = make_harness(max_num_batched_tokens=8, num_blocks=40, fair_share=True)
    h.add("a1", toks(10, 24), share=A)
    paused = h.schedule()
    b1 = h.add("b1", toks(80, 12), share=B)
    b2 = h.add("b2", toks(100, 3), share=B)
    out = urgent(h, [b2, b1], paused)
    assert h.scheduled(out) == [("b1", 8)]  # arrival order within the tenant; budget spent
    h.update(out)
    h.update(paused)
    assert h.waiting == ["b2"]
    # Ordinary steps: A (8) has received less than B (lifted to 8, then 8 more) and goes
    # first; at the tie that follows, B (active most recently) goes first and A gives way.
    steps = [h.scheduled(h.step()[0]) for _ in range(2)]
    assert steps == [[("a1", 8)], [("b1", 4), ("b2", 3), ("a1", 1)]]
    h.run_to_completion()
    h.assert_all_blocks_free()


def test_a_block_the_paused_step_is_computing_is_never_recomputed_or_hit(make_harness):
    # Same salt (no share): x shares a1's first 8 tokens, which the paused step is computing.
    h = make_harness(max_num_batched_tokens=8, num_blocks=40, fair_share=True)
    h.add("a1", toks(10, 12))
    paused = h.schedule()
    assert h.scheduled(paused) == [("a1", 8)]
    x = h.add("x", toks(10, 8) + toks(70, 5))
    queries = h.kv.stats.queries
    out = urgent(h, [x], paused)
    assert h.scheduled(out) == []
    assert h.waiting == ["x"] and h.kv.stats.queries == queries  # no lookup was counted
    h.update(paused)
    out, _ = h.step()  # next ordinary step: the two blocks are hits now
    assert h.scheduled(out) == [("a1", 4), ("x", 4)]
    assert x.num_cached_tokens == 8
    assert h.block_ids("x")[:2] == h.block_ids("a1")[:2]


def test_no_preemption_when_the_new_request_does_not_fit(make_harness):
    h = make_harness(max_num_batched_tokens=8, num_blocks=4, fair_share=True)
    h.add("a1", toks(10, 12), share=A, max_tokens=2)
    h.step()
    paused = h.schedule()
    assert h.scheduled(paused) == [("a1", 4)]
    b1 = h.add("b1", toks(80, 6), share=B, max_tokens=2)  # 2 blocks; 1 is free
    out = urgent(h, [b1], paused)
    assert h.scheduled(out) == [] and out.preempted == []
    assert h.running == ["a1"] and h.waiting == ["b1"]
    assert h.block_ids("a1") == [0, 1, 2]
    h.update(paused)
    h.run_to_completion()
    h.assert_all_blocks_free()


def test_seats_and_waiting_are_checked(make_harness):
    h = make_harness(max_num_batched_tokens=8, num_blocks=40, max_num_seqs=2, fair_share=True)
    h.add("a1", toks(10, 6), share=A)
    h.add("a2", toks(40, 6), share=A)
    h.step()
    paused = h.schedule()
    assert h.running == ["a1", "a2"]
    b1 = h.add("b1", toks(80, 4), share=B)
    assert h.scheduled(urgent(h, [b1], paused)) == []  # no seat
    a1 = h.scheduler.requests["a1"]
    with pytest.raises(ValueError, match="'a1' is not waiting"):
        schedule_urgent(h.scheduler, [a1], paused)
