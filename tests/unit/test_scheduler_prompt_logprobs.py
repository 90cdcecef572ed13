"""Prompt logprobs in the scheduler and the flat batch: no prefix-cache reads, entries written
by position over chunked prefill, one delivery with the first token, none twice after preemption.

A stand-in runner gives position p's entry (that of prompt token p + 1) the logprob -p, so a
delivered list shows at once whether any position is missing, repeated or out of order.
"""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import RequestUpdate, SchedulerOutput
from engine.logprobs import Logprob, TokenLogprobs
from engine.worker.input_batch import build_model_input

TOKEN = 500  # what the stand-in sampler always returns


def fake_entries(out: SchedulerOutput) -> dict[str, list[TokenLogprobs]]:
    """The spec: positions p of the chunk with p + 1 < num_prompt_tokens, for requests owing."""
    entries = {}
    for item in out.scheduled:
        request = item.request
        if not request.needs_prompt_logprobs:
            continue
        start = request.num_computed_tokens
        end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
        prompt = request.prompt_token_ids
        entries[request.request_id] = [
            TokenLogprobs(Logprob(prompt[p + 1], -float(p), 1)) for p in range(start, end)
        ]
    return entries


def step(h) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    out = h.schedule()
    sampled = {s.request.request_id: TOKEN for s in out.scheduled if s.samples}
    updates = h.scheduler.update_from_output(out, sampled, None, fake_entries(out))
    h.scheduler.check_integrity()
    return out, updates


def run(h) -> tuple[list[RequestUpdate], dict[str, int]]:
    """Step to completion: all updates, and each preempted request's outputs when first hit."""
    updates: list[RequestUpdate] = []
    preempted_with: dict[str, int] = {}
    for _ in range(500):
        if not h.scheduler.has_unfinished_requests():
            return updates, preempted_with
        out, new = step(h)
        updates.extend(new)
        for request in out.preempted:
            preempted_with.setdefault(request.request_id, request.num_output_tokens)
    raise AssertionError("no progress")


def expected(request: Request) -> list[TokenLogprobs | None]:
    prompt = request.prompt_token_ids
    return [None] + [
        TokenLogprobs(Logprob(prompt[p + 1], -float(p), 1)) for p in range(len(prompt) - 1)
    ]


def delivered(updates: list[RequestUpdate], request_id: str) -> list[list[TokenLogprobs | None]]:
    return [
        u.prompt_logprobs
        for u in updates
        if u.request.request_id == request_id and u.prompt_logprobs is not None
    ]


def test_no_prefix_lookup_but_blocks_are_cached_for_others(make_harness):
    h = make_harness()
    prompt = list(range(10, 19))  # 9 tokens: two full blocks of 4
    h.add("a", prompt, max_tokens=1)
    h.run_to_completion()
    queries = h.kv.stats.queries
    b = h.add("b", prompt, max_tokens=1, prompt_logprobs=0)
    out, updates = step(h)
    assert h.scheduled(out) == [("b", 9)]  # the cached 8 tokens are computed again
    assert b.num_cached_tokens == 0
    assert h.kv.stats.queries == queries  # no lookup, so no query
    assert delivered(updates, "b") == [expected(b)]
    fresh = list(range(50, 59))
    h.add("c", fresh, max_tokens=1, prompt_logprobs=1)
    step(h)
    d = h.add("d", fresh, max_tokens=1)
    step(h)
    assert d.num_cached_tokens == 8  # c's blocks serve a plain request
    h.assert_all_blocks_free()


def test_entries_arrive_whole_with_the_first_token_only(make_harness):
    h = make_harness(max_num_batched_tokens=4)
    a = h.add("a", list(range(20, 30)), max_tokens=3, prompt_logprobs=2)
    chunks = []
    all_updates = []
    while h.scheduler.has_unfinished_requests():
        out, updates = step(h)
        chunks.append(h.scheduled(out)[0][1])
        all_updates.extend(updates)
    assert chunks == [4, 4, 2, 1, 1]
    assert [u.prompt_logprobs is not None for u in all_updates] == [True, False, False]
    assert all_updates[0].prompt_logprobs == expected(a)
    assert all_updates[0].new_token_ids == [TOKEN]
    assert a.pending_prompt_logprobs == []


def test_one_token_prompt_gets_a_single_none(make_harness):
    h = make_harness()
    h.add("a", [5], max_tokens=2, prompt_logprobs=3)
    h.add("b", [6], max_tokens=2)
    _, updates = step(h)
    assert [(u.request.request_id, u.prompt_logprobs) for u in updates] == [
        ("a", [None]), ("b", None)
    ]


def test_preempted_while_prefilling_delivers_each_entry_once(make_harness):
    # b's 16-token prompt needs 4 of the 5 blocks; a (older) keeps growing and preempts it.
    h = make_harness(num_blocks=5, max_num_batched_tokens=6)
    h.add("a", [1, 2, 3], max_tokens=12)
    b = h.add("b", list(range(40, 56)), max_tokens=2, prompt_logprobs=1)
    updates, preempted_with = run(h)
    assert preempted_with["b"] == 0 and b.num_preemptions > 0
    assert delivered(updates, "b") == [expected(b)]
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 2
    h.assert_all_blocks_free()


def test_preempted_after_first_token_never_resends(make_harness):
    h = make_harness(num_blocks=5, max_num_batched_tokens=8)
    h.add("a", [1, 2, 3], max_tokens=14)
    b = h.add("b", list(range(40, 46)), max_tokens=10, prompt_logprobs=1)
    updates, preempted_with = run(h)
    assert preempted_with["b"] > 0
    assert delivered(updates, "b") == [expected(b)]
    assert b.num_output_tokens == 10
    # Only a's admission and b's resumptions looked up the cache: b's first admission did not.
    resumed_tokens = h.kv.stats.queries - 3
    assert b.num_preemptions == 1
    assert resumed_tokens == 6 + preempted_with["b"]
    h.assert_all_blocks_free()


def test_flat_batch_rows_cover_the_chunks_prompt_positions(make_harness):
    h = make_harness(max_num_batched_tokens=16)
    plain = h.add("plain", [1, 2, 3], max_tokens=2)
    a = h.add("a", list(range(30, 50)), max_tokens=2, prompt_logprobs=3)
    out = h.schedule()
    assert h.scheduled(out) == [("plain", 3), ("a", 13)]
    block_ids = {r.request_id: h.block_ids(r.request_id) for r in (plain, a)}
    batch = build_model_input(out.scheduled, block_ids, h.kv.block_size)
    [rows] = batch.prompt_logprob_rows
    # a's positions 0..12 sit at flat rows 3..15 and predict prompt tokens 1..13.
    assert (rows.request_id, rows.offset, rows.num_top) == ("a", 3, 3)
    assert rows.target_ids == a.prompt_token_ids[1:14]
    h.update(out)
    # The last chunk stops one short: position 19 predicts the first sampled token.
    out = h.schedule()
    assert h.scheduled(out) == [("plain", 1), ("a", 7)]
    block_ids = {r.request_id: h.block_ids(r.request_id) for r in (plain, a)}
    [rows] = build_model_input(out.scheduled, block_ids, h.kv.block_size).prompt_logprob_rows
    assert (rows.offset, rows.target_ids) == (1, a.prompt_token_ids[14:20])
