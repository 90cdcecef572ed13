"""Request: token bookkeeping, incremental block hashes, sort key and statuses."""

import pytest

from engine.core.request import Request, RequestStatus
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.contracts.sampling_params import SamplingParams

BS = 4


def make_request(prompt, seq=0, priority=0, **kwargs):
    return Request(
        request_id="r",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(),
        max_tokens=16,
        block_size=BS,
        arrival_seq=seq,
        priority=priority,
        **kwargs,
    )


def test_initial_state():
    request = make_request(range(6))
    assert request.num_tokens == request.num_prompt_tokens == 6
    assert request.num_output_tokens == 0
    assert request.num_computed_tokens == 0
    assert request.num_cached_tokens is None
    assert request.status == RequestStatus.WAITING
    assert request.all_token_ids == list(range(6))
    assert len(request.block_hashes) == 1


def test_prompt_is_not_aliased():
    prompt = [1, 2, 3]
    request = make_request(prompt)
    request.append_output_token(9)
    assert prompt == [1, 2, 3]
    assert request.prompt_token_ids == [1, 2, 3]
    assert request.all_token_ids == [1, 2, 3, 9]


@pytest.mark.parametrize(("salt", "lora"), [(None, None), ("tenant", None), (None, "l1")])
def test_block_hashes_grow_with_outputs_and_match_hashing_from_scratch(salt, lora):
    request = make_request(range(5), cache_salt=salt, lora_id=lora)
    counts = []
    for token in range(100, 112):
        request.append_output_token(token)
        counts.append(len(request.block_hashes))
        expected = hash_token_blocks(request.all_token_ids, BS, cache_salt=salt, lora_id=lora)
        assert request.block_hashes == expected
    # 5 prompt tokens + k outputs: a new hash each time the token count reaches a multiple of 4.
    assert counts == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    assert request.num_tokens == 17
    assert request.num_output_tokens == 12
    assert request.output_token_ids == list(range(100, 112))


def test_salted_request_hashes_differ_from_unsalted():
    assert (
        make_request(range(8), cache_salt="t").block_hashes != make_request(range(8)).block_hashes
    )


def test_sort_key_priority_then_arrival():
    requests = [
        make_request([1], seq=0, priority=1),
        make_request([1], seq=1, priority=0),
        make_request([1], seq=2, priority=0),
        make_request([1], seq=3, priority=-5),
    ]
    order = sorted(requests, key=lambda r: r.sort_key)
    assert [r.arrival_seq for r in order] == [3, 1, 2, 0]


@pytest.mark.parametrize(
    ("status", "finished", "reason"),
    [
        (RequestStatus.WAITING, False, None),
        (RequestStatus.RUNNING, False, None),
        (RequestStatus.PREEMPTED, False, None),
        (RequestStatus.FINISHED_STOPPED, True, "stop"),
        (RequestStatus.FINISHED_LENGTH, True, "length"),
        (RequestStatus.FINISHED_ABORTED, True, "abort"),
    ],
)
def test_status_finished_and_reason(status, finished, reason):
    assert status.finished is finished
    assert status.finish_reason == reason
