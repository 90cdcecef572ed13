"""Stop conditions and aborts: stop tokens, EOS, min_tokens, max_tokens, max_model_len, stop
strings matched by the caller; logprobs carried in the updates."""

import pytest

from engine.core.request import RequestStatus
from engine.logprobs import Logprob, TokenLogprobs


def tokens_from(sequence):
    """A sampler stand-in that returns the next token of `sequence` for each call."""
    it = iter(sequence)
    return lambda request: next(it)


def test_stop_token_finishes_with_stop_reason(make_harness):
    h = make_harness()
    a = h.add("a", [1, 2, 3, 4], max_tokens=10, stop_token_ids=[9])
    _, updates = h.step(5)
    assert [(u.new_token_ids, u.finished) for u in updates] == [([5], False)]
    _, updates = h.step(9)
    assert [(u.new_token_ids, u.finished) for u in updates] == [([9], True)]
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.status.finish_reason == "stop"
    assert a.stop_reason == 9
    assert a.output_token_ids == [5, 9]  # the stop token is kept in the output
    assert not h.scheduler.has_unfinished_requests()
    h.assert_all_blocks_free()


def test_eos_stops_unless_ignored(make_harness):
    h = make_harness()
    a = h.add("a", [1, 2, 3], max_tokens=5, eos_token_ids=[2], ignore_eos=False)
    b = h.add("b", [1, 2, 3], max_tokens=5, eos_token_ids=[2], ignore_eos=True)
    _, updates = h.step(2)
    assert [(u.request.request_id, u.finished) for u in updates] == [("a", True), ("b", False)]
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.stop_reason is None  # EOS is not a stop_token_ids hit
    h.run_to_completion()
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [2, 500, 500, 500, 500]


def test_tokens_other_than_eos_do_not_stop(make_harness):
    h = make_harness()
    a = h.add("a", [1, 2, 3], max_tokens=2, eos_token_ids=[2], ignore_eos=False)
    h.step(3)
    h.step(4)
    assert a.status == RequestStatus.FINISHED_LENGTH


def test_min_tokens_suppresses_stop_token_and_eos(make_harness):
    h = make_harness()
    a = h.add(
        "a",
        [1, 2, 3],
        max_tokens=10,
        min_tokens=3,
        stop_token_ids=[9],
        eos_token_ids=[2],
        ignore_eos=False,
    )
    sampler = tokens_from([9, 2, 9])
    finished = [h.step(sampler)[1][0].finished for _ in range(3)]
    assert finished == [False, False, True]
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.stop_reason == 9
    assert a.output_token_ids == [9, 2, 9]


def test_min_tokens_then_eos(make_harness):
    h = make_harness()
    a = h.add("a", [1, 2, 3], max_tokens=10, min_tokens=2, eos_token_ids=[2], ignore_eos=False)
    h.step(2)
    assert a.status == RequestStatus.RUNNING
    h.step(2)
    assert a.status == RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_finishes_with_length(make_harness, max_tokens):
    h = make_harness()
    a = h.add("a", [1, 2, 3], max_tokens=max_tokens)
    steps = h.run_to_completion()
    assert steps == max_tokens
    assert a.num_output_tokens == max_tokens
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.status.finish_reason == "length"
    assert a.stop_reason is None
    h.assert_all_blocks_free()


def test_max_model_len_finishes_with_length(make_harness):
    h = make_harness(max_model_len=8)
    a = h.add("a", [1, 2, 3, 4, 5, 6], max_tokens=10)
    assert h.run_to_completion() == 2
    assert a.num_tokens == 8
    assert a.status == RequestStatus.FINISHED_LENGTH


def test_abort_waiting_request(make_harness):
    h = make_harness(max_num_seqs=1)
    h.add("a", [1, 2, 3])
    b = h.add("b", [4, 5, 6])
    h.step()
    assert h.waiting == ["b"]
    assert h.scheduler.abort_request("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert b.status.finish_reason == "abort"
    assert h.waiting == [] and h.running == ["a"]
    assert "b" not in h.scheduler.requests
    h.scheduler.check_integrity()


def test_abort_running_request_frees_its_blocks(make_harness):
    h = make_harness()
    a = h.add("a", list(range(1, 10)))
    h.add("b", [50, 51])
    h.step()
    assert h.block_ids("a") == [0, 1, 2]
    assert h.kv.num_free_blocks == 6
    assert h.scheduler.abort_request("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert h.running == ["b"]
    assert h.block_ids("a") == []
    assert h.kv.num_free_blocks == 9
    # Freed tail first: the partial block to the front, full cached blocks to the back.
    assert h.kv.pool.free_queue.block_ids() == [2, 4, 5, 6, 7, 8, 9, 1, 0]
    h.scheduler.check_integrity()


def test_abort_between_schedule_and_update(make_harness):
    h = make_harness()
    a = h.add("a", [1, 2, 3, 4, 5])
    b = h.add("b", [6, 7, 8])
    out = h.schedule()
    h.scheduler.abort_request("a")
    h.scheduler.check_integrity()
    updates = h.update(out)
    assert [u.request.request_id for u in updates] == ["b"]
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    assert b.num_computed_tokens == 3 and b.output_token_ids == [500]
    assert h.block_ids("a") == []


def test_abort_mid_chunked_prefill(make_harness):
    h = make_harness(max_num_batched_tokens=4)
    a = h.add("a", list(range(1, 11)))
    h.step()
    h.step()
    assert a.num_computed_tokens == 8
    h.scheduler.abort_request("a")
    h.assert_all_blocks_free()
    assert not h.scheduler.has_unfinished_requests()


def test_abort_unknown_or_finished_request_returns_none(make_harness):
    h = make_harness()
    assert h.scheduler.abort_request("nope") is None
    h.add("a", [1, 2], max_tokens=1)
    h.step()
    assert h.scheduler.abort_request("a") is None
    h.add("b", [1, 2])
    h.scheduler.abort_request("b")
    assert h.scheduler.abort_request("b") is None


def test_all_blocks_free_after_mixed_finishes_and_aborts(make_harness):
    h = make_harness(num_blocks=8, max_num_batched_tokens=6)
    h.add("stop", [1, 2, 3, 4, 5], max_tokens=10, stop_token_ids=[7])
    h.add("len", [1, 2, 3, 4, 6], max_tokens=3)
    h.add("abort", [9, 9, 9, 9, 9, 9, 9])
    h.step(5)
    h.scheduler.abort_request("abort")
    h.step(5)
    h.step(7)
    h.run_to_completion()
    h.assert_all_blocks_free()


def test_stop_request_finishes_with_the_stop_string_and_frees_blocks(make_harness):
    h = make_harness()
    a = h.add("a", 6, max_tokens=10)
    b = h.add("b", list(range(101, 107)), max_tokens=10)
    h.step()
    assert h.scheduler.stop_request("a", "###") is a
    h.scheduler.check_integrity()
    assert (a.status, a.status.finish_reason, a.stop_reason) == (
        RequestStatus.FINISHED_STOPPED, "stop", "###"
    )
    assert h.running == ["b"] and h.block_ids("a") == []
    assert h.scheduler.stop_request("a", "###") is None  # already finished: a no-op
    h.run_to_completion()
    assert b.status == RequestStatus.FINISHED_LENGTH
    h.assert_all_blocks_free()


def test_updates_carry_logprobs_only_for_requests_given_them(make_harness):
    h = make_harness()
    h.add("a", 3, logprobs=1)
    h.add("b", 3)
    out = h.schedule()
    token = TokenLogprobs(Logprob(7, -0.5, 1), (Logprob(7, -0.5, 1),))
    updates = h.scheduler.update_from_output(out, {"a": 7, "b": 7}, {"a": token})
    assert [(u.request.request_id, u.new_logprobs) for u in updates] == [
        ("a", [token]), ("b", None)
    ]
