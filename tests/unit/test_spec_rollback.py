"""Speculative decoding in the scheduler: drafts in the budget, KV rollback with exact blocks.

Block size 4, 10 blocks, handed out from the front of the free queue (0, 1, 2, ...).
"""

from __future__ import annotations

import dataclasses

from engine.core.request import RequestStatus
from engine.core.scheduler_output import SchedulerOutput
from engine.spec_decode.spec_scheduling import VerifiedTokens


def verify(h, out: SchedulerOutput, tokens: dict[str, list[int]]):
    updates = h.scheduler.update_from_output(
        out, {}, verified={rid: VerifiedTokens(t) for rid, t in tokens.items()}
    )
    h.scheduler.check_integrity()
    return updates


def decoding(h, prompt=6, **kwargs):
    """One request with `prompt` tokens 1..prompt, prefilled, first token 500 sampled."""
    request = h.add("a", prompt, **kwargs)
    h.step()
    assert request.output_token_ids == [500]
    return request


def cached_block_ids(h) -> set[int]:
    return {block.block_id for block in h.kv.pool.cached.values()}


def test_rejected_drafts_blocks_are_freed_and_never_cached(make_harness):
    h = make_harness()
    request = decoding(h)
    assert h.block_ids("a") == [0, 1]
    request.spec_token_ids = [7, 8, 9, 10, 11, 12]
    out = h.schedule()
    assert [(s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [
        (7, (7, 8, 9, 10, 11, 12))
    ]
    # Positions 6..12 (13 tokens) need 4 blocks.
    assert h.block_ids("a") == [0, 1, 2, 3]
    (update,) = verify(h, out, {"a": [7, 99]})  # draft 1 kept, draft 2 corrected to 99
    assert update.new_token_ids == [7, 99] and not update.finished
    assert request.output_token_ids == [500, 7, 99]
    # Positions 0..7 hold kept tokens (prompt, 500, 7); 8.. only rejected drafts.
    assert request.num_computed_tokens == 8 and request.num_tokens == 9
    assert h.block_ids("a") == [0, 1]
    assert h.kv.num_free_blocks == 8
    assert cached_block_ids(h) == {0, 1}
    assert [h.kv.pool.blocks[i].block_hash for i in (0, 1)] == request.block_hashes[:2]
    # The freed blocks went to the front of the queue: the next step takes 2 again.
    request.spec_token_ids = []
    h.step()
    assert h.block_ids("a") == [0, 1, 2]


def test_all_drafts_kept_plus_bonus(make_harness):
    h = make_harness()
    request = decoding(h, prompt=5)
    request.spec_token_ids = [6, 7, 8]
    out = h.schedule()
    assert h.block_ids("a") == [0, 1, 2]  # positions 5..8: 9 tokens
    (update,) = verify(h, out, {"a": [6, 7, 8, 42]})
    assert update.new_token_ids == [6, 7, 8, 42]
    assert request.num_computed_tokens == 9 and request.num_tokens == 10
    assert h.block_ids("a") == [0, 1, 2]
    assert cached_block_ids(h) == {0, 1}  # block 2 holds position 8 only


def test_no_draft_kept_rolls_back_to_one_token(make_harness):
    h = make_harness()
    request = decoding(h, prompt=8)  # 8 prompt tokens fill blocks 0, 1
    request.spec_token_ids = [1, 2, 3, 4, 5]
    out = h.schedule()
    assert h.block_ids("a") == [0, 1, 2, 3]
    verify(h, out, {"a": [77]})
    assert request.num_computed_tokens == 9
    assert h.block_ids("a") == [0, 1, 2]


def test_stop_token_inside_the_kept_run_ends_there(make_harness):
    h = make_harness()
    request = decoding(h, stop_token_ids=[8])
    request.spec_token_ids = [7, 8, 9]
    out = h.schedule()
    (update,) = verify(h, out, {"a": [7, 8, 9, 10]})
    assert update.new_token_ids == [7, 8] and update.finished
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == 8
    assert request.output_token_ids == [500, 7, 8]
    h.assert_all_blocks_free()
    # Only the blocks of kept tokens were offered to the cache: [1..4], [5, 6, 500, 7].
    assert cached_block_ids(h) == {0, 1}


def test_max_tokens_bounds_the_drafts(make_harness):
    h = make_harness()
    request = decoding(h, max_tokens=3)
    request.spec_token_ids = [7, 8, 9]
    out = h.schedule()
    # One output exists; one draft plus the bonus token reach max_tokens.
    assert [s.spec_token_ids for s in out.scheduled] == [(7,)]
    (update,) = verify(h, out, {"a": [7, 31]})
    assert update.finished and request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [500, 7, 31]


def test_short_budget_cuts_drafts(make_harness):
    h = make_harness(max_num_batched_tokens=4)
    request = h.add("a", 3)
    h.step()
    request.spec_token_ids = [1, 2, 3, 4, 5]
    out = h.schedule()
    assert [s.spec_token_ids for s in out.scheduled] == [(1, 2, 3)]


def test_disable_by_batch_size(make_harness):
    h = make_harness()
    h.scheduler.config = dataclasses.replace(h.scheduler.config, spec_disable_by_batch_size=2)
    a = decoding(h)
    h.add("b", 3)
    h.step()
    a.spec_token_ids = [1, 2]
    out = h.schedule()
    assert [(s.request.request_id, s.spec_token_ids) for s in out.scheduled] == [
        ("a", ()),
        ("b", ()),
    ]


def test_drafts_leave_a_block_for_each_request_behind(make_harness):
    h = make_harness(num_blocks=4)
    a = h.add("a", 4)
    h.add("b", 4)
    h.step()
    assert h.block_ids("a") == [0] and h.block_ids("b") == [1]
    # Four drafts would need blocks 2 and 3, but b's decode needs one: a verifies three.
    a.spec_token_ids = [1, 2, 3, 4]
    out = h.schedule()
    assert h.scheduled(out) == [("a", 4), ("b", 1)]
    assert out.preempted == []
    assert h.block_ids("a") == [0, 2] and h.block_ids("b") == [1, 3]


def test_no_free_block_no_drafts(make_harness):
    h = make_harness(num_blocks=2)
    a = h.add("a", 2)
    h.step()
    h.add("b", 2)
    h.step()
    assert h.kv.num_free_blocks == 0
    a.spec_token_ids = [1, 2, 3]
    out = h.schedule()
    # Position 3 still fits a's block 0; a draft would need another block.
    assert [(s.request.request_id, s.spec_token_ids) for s in out.scheduled] == [
        ("a", ()),
        ("b", ()),
    ]


def test_drafts_of_a_prefilling_request_are_ignored(make_harness):
    h = make_harness(max_num_batched_tokens=4)
    request = h.add("a", 10)
    request.spec_token_ids = [1, 2]
    out = h.schedule()
    assert [s.spec_token_ids for s in out.scheduled] == [()]
