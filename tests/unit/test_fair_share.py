"""Weighted fair share (VTC) in the scheduler on tiny configs: exact expected orders.

Block size 4, token budget 8: every step's scheduled chunks are spelled out, with the FCFS
schedule beside them where the two differ.
"""

from engine.core.fair_share import FairShare
from engine.core.request import TenantShare


def toks(start, n):
    return list(range(start, start + n))


def A(weight=1.0):
    return TenantShare("A", weight)


def B(weight=1.0):
    return TenantShare("B", weight)


def test_waiting_requests_are_admitted_least_served_tenant_first(make_harness):
    # B is lifted to A's 8: a tie, which goes to the tenant active most recently; a1 gives
    # way for the step and gets what b1 leaves; a2, behind a1 in A's own order, waits for it.
    for fair, expected in (
        (True, [[("b1", 4), ("a1", 4)], [("a1", 5), ("b1", 1), ("a2", 2)]]),
        (False, [[("a1", 8)], [("a1", 1), ("a2", 7)]]),
    ):
        h = make_harness(max_num_batched_tokens=8, num_blocks=40, fair_share=fair)
        h.add("a1", toks(10, 17), share=A())
        h.add("a2", toks(40, 16), share=A())
        h.step()
        h.add("b1", toks(80, 4), share=B())
        steps = [h.scheduled(h.step()[0]) for _ in range(2)]
        assert steps == expected, f"fair={fair}"


def test_a_running_prompt_gives_way_to_a_less_served_tenant(make_harness):
    h = make_harness(max_num_batched_tokens=8, num_blocks=40, fair_share=True)
    h.add("a1", toks(10, 24), share=A())
    out, _ = h.step()
    assert h.scheduled(out) == [("a1", 8)]
    h.add("b1", toks(80, 4), share=B())
    assert h.scheduler.fair_share.counters == {"A": 8.0, "B": 8.0}  # lifted: a tie
    out, _ = h.step()
    # b1 first (the tie goes to the tenant active most recently); a1 is deferred, not
    # dropped: it gets what b1 leaves (work-conserving).
    assert h.scheduled(out) == [("b1", 4), ("a1", 4)]
    assert h.scheduler.fair_share.counters == {"A": 12.0, "B": 12.0}
    out, _ = h.step()
    # A tie again, but b1 now decodes, and a1's prompt has no prompt of another tenant to give
    # way to: running order (a1 first) spends the budget, as under FCFS.
    assert h.scheduled(out) == [("a1", 8)]
    out, _ = h.step()
    assert h.scheduled(out) == [("a1", 4), ("b1", 1)]
    assert h.scheduler.fair_share.counters == {"A": 24.0, "B": 13.0}


def test_fcfs_keeps_the_running_prompt_first(make_harness):
    h = make_harness(max_num_batched_tokens=8, num_blocks=40)
    h.add("a1", toks(10, 24), share=A())
    h.step()
    h.add("b1", toks(80, 4), share=B())
    h.step()
    out, _ = h.step()
    assert h.scheduled(out) == [("a1", 8)]


def test_weights_divide_the_charge_and_priority_still_comes_first(make_harness):
    fair = FairShare()
    h = make_harness(max_num_batched_tokens=8, num_blocks=40, fair_share=True)
    h.scheduler.fair_share = fair
    h.add("b1", toks(80, 8), share=B(weight=2.0))
    out, _ = h.step()
    assert fair.counters["B"] == 4.0  # 8 tokens / weight 2
    h.add("a1", toks(10, 8), share=A(), priority=1)
    h.add("a2", toks(30, 8), share=A(), priority=-1)
    h.add("b2", toks(50, 8), share=B(weight=2.0))
    assert [r.request_id for r in fair.admission_order(h.scheduler.waiting)] == [
        "a2", "b2", "a1"]


def test_an_arriving_tenant_banks_no_credit(make_harness):
    h = make_harness(max_num_batched_tokens=8, num_blocks=40, fair_share=True)
    h.add("a1", toks(10, 16), share=A())
    h.step()
    h.step()
    assert h.scheduler.fair_share.counters["A"] == 16.0
    h.add("c1", toks(80, 4), share=TenantShare("C"))
    assert h.scheduler.fair_share.counters["C"] == 16.0  # lifted to the least served present


def test_a_lone_tenant_schedules_exactly_as_fcfs(make_harness):
    runs = []
    for fair in (True, False):
        h = make_harness(max_num_batched_tokens=8, num_blocks=40, fair_share=fair)
        for index in range(5):
            h.add(f"r{index}", toks(10 * index + 1, 3 + 3 * index), share=A(), max_tokens=3)
        steps = []
        while h.scheduler.has_unfinished_requests():
            out, _ = h.step()
            steps.append(h.scheduled(out))
        runs.append(steps)
    assert runs[0] == runs[1]


def test_without_a_share_the_cache_salt_is_the_tenant(make_harness):
    h = make_harness(max_num_batched_tokens=8, num_blocks=40, fair_share=True)
    h.add("x", toks(10, 8), cache_salt="salty")
    h.step()
    assert h.scheduler.fair_share.counters == {"salty": 8.0}
