"""Randomized soak: many requests, priorities, aborts and a tiny pool that forces preemption.

Besides check_integrity() after every schedule() and update, a shadow KV cache records which
token each (block, slot) holds: every scheduled request writes its new positions, then every
scheduled request must read back its own tokens for all positions it attends to. A prefix hit on
the wrong block, a shared block overwritten, or a block reused while still referenced shows up as
a mismatch.
"""

import random

import pytest

from engine.core.request import RequestStatus

BS = 4
SHARED_PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23]]


class ShadowKV:
    def __init__(self, num_blocks):
        self.slots = {block_id: [None] * BS for block_id in range(num_blocks)}

    def step(self, harness, out):
        for s in out.scheduled:
            request = s.request
            block_ids = harness.block_ids(request.request_id)
            start = request.num_computed_tokens
            for pos in range(start, start + s.num_new_tokens):
                self.slots[block_ids[pos // BS]][pos % BS] = request.all_token_ids[pos]
        for s in out.scheduled:
            request = s.request
            block_ids = harness.block_ids(request.request_id)
            end = request.num_computed_tokens + s.num_new_tokens
            assert len(block_ids) == -(-end // BS), request.request_id
            seen = [self.slots[block_ids[pos // BS]][pos % BS] for pos in range(end)]
            assert seen == request.all_token_ids[:end], request.request_id


def random_prompt(rng):
    prompt = list(rng.choice(SHARED_PREFIXES)) if rng.random() < 0.5 else []
    prompt += [rng.randrange(30, 60) for _ in range(rng.randint(1, 12))]
    return prompt[:20]


def check_request_state(harness):
    for request in harness.scheduler.waiting:
        assert harness.block_ids(request.request_id) == []
        assert request.num_computed_tokens == 0
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for request in harness.scheduler.running:
        assert request.status == RequestStatus.RUNNING
        assert len(harness.block_ids(request.request_id)) >= -(-request.num_computed_tokens // BS)
        assert request.num_computed_tokens <= request.num_tokens


# engine.core.long_prefill_limit's policies, with a threshold that makes shared-prefix
# followers short and fresh prompts long.
LONG_PREFILLS = {"max_long_partial_prefills": 1, "short_prefill_steps": True,
                 "long_prefill_token_threshold": 6}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("policy", [{}, LONG_PREFILLS], ids=["fcfs", "long-prefills"])
def test_random_soak_runs_to_completion(make_harness, seed, chunked, policy):
    rng = random.Random(seed)
    num_blocks = 10  # the longest request (20 + 12 tokens) needs 8
    h = make_harness(
        num_blocks=num_blocks,
        max_num_seqs=6,
        max_num_batched_tokens=32 if not chunked else 12,
        max_model_len=64,
        enable_chunked_prefill=chunked,
        **policy,
    )
    shadow = ShadowKV(num_blocks)
    pending = list(range(30))
    requests = []
    aborted = set()
    steps = 0
    while pending or h.scheduler.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i = pending.pop(0)
                requests.append(
                    h.add(
                        f"r{i}",
                        random_prompt(rng),
                        max_tokens=rng.randint(1, 12),
                        priority=rng.randint(0, 2),
                        stop_token_ids=[7] if rng.random() < 0.3 else [],
                        eos_token_ids=[0],
                        ignore_eos=rng.random() < 0.5,
                        cache_salt=rng.choice([None, None, "tenant"]),
                    )
                )
        out = h.schedule()
        check_request_state(h)
        shadow.step(h, out)
        if rng.random() < 0.08 and h.scheduler.requests:
            victim = rng.choice(sorted(h.scheduler.requests))
            assert h.scheduler.abort_request(victim) is not None
            aborted.add(victim)
            h.scheduler.check_integrity()
        h.update(out, lambda r: rng.choice([0, 7, 40, 41, 42, 43, 44, 45]))
        check_request_state(h)
        steps += 1
        assert steps < 2000, "no progress"

    assert len(requests) == 30
    h.assert_all_blocks_free()
    assert h.scheduler.requests == {}
    for request in requests:
        assert request.status.finished, request.request_id
        assert request.num_output_tokens <= request.max_tokens
        if request.request_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
        elif request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.max_tokens
        else:
            assert request.status == RequestStatus.FINISHED_STOPPED
            last = request.output_token_ids[-1]
            assert last in request.sampling_params.stop_token_ids or (
                last == 0 and not request.sampling_params.ignore_eos
            )
    assert h.kv.stats.hits > 0  # shared prefixes were actually reused


def test_soak_actually_preempts(make_harness):
    rng = random.Random(1234)
    h = make_harness(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=16)
    shadow = ShadowKV(8)
    for i in range(30):
        h.add(
            f"r{i}",
            random_prompt(rng)[:12],
            max_tokens=rng.randint(4, 12),
            priority=rng.randint(0, 2),
        )
    steps = 0
    while h.scheduler.has_unfinished_requests():
        out = h.schedule()
        shadow.step(h, out)
        h.update(out, lambda r: rng.randrange(40, 50))
        steps += 1
        assert steps < 2000, "no progress"
    assert h.scheduler.num_preemptions > 0
    h.assert_all_blocks_free()
