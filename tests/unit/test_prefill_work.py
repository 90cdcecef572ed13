"""What engines publish for the routers' cost model (engine.service.prefill_work): exact figures.

The scheduler harness (tests/unit/conftest.py, block size 4) stands in for the engine: the
functions only read `scheduler` and `kv`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engine.service.prefill_work import (
    MAX_FIT_GAIN,
    MIN_PREFILL_SHARE,
    StepRates,
    decoding_requests,
    queued_prefill_tokens,
)


def test_queued_work_counts_a_shared_prefix_once(make_harness: Callable[..., Any]) -> None:
    h = make_harness(num_blocks=40, max_num_seqs=1, max_num_batched_tokens=8)
    prefix = list(range(100, 116))  # 4 blocks
    h.add("a", prefix + [1, 2, 3])
    h.add("b", prefix + [4, 5, 6])
    h.add("c", [7] * 9)
    # a: 19 tokens; b: its 4 prefix blocks are a's, only 3 of its own; c: 9.
    assert queued_prefill_tokens(h) == 19 + 3 + 9
    h.step()  # a computes 8 tokens (one chunk)
    assert queued_prefill_tokens(h) == 11 + 3 + 9
    assert decoding_requests(h) == 0


def test_queued_work_skips_cached_blocks_and_decodes(make_harness: Callable[..., Any]) -> None:
    h = make_harness(num_blocks=40, max_num_seqs=2, max_num_batched_tokens=64)
    prefix = list(range(100, 116))
    h.add("a", prefix + [1])
    h.step()  # a's prompt computed, its 4 blocks cached; a now decodes
    assert queued_prefill_tokens(h) == 0
    assert decoding_requests(h) == 1
    h.add("b", prefix + [2, 3])  # waiting: 4 cached blocks, 2 tokens to compute
    assert queued_prefill_tokens(h) == 2


def test_step_rates_start_unknown_and_separate_decode_from_prefill() -> None:
    rates = StepRates()
    assert (rates.prefill_tokens_per_s, rates.decode_s_per_seq) == (0.0, 0.0)
    rates.observe(0.04, num_tokens=4, num_decoding=4)  # pure decode: 10 ms per sequence
    assert rates.decode_s_per_seq == pytest.approx(0.01)
    assert rates.prefill_tokens_per_s == 0.0
    rates.observe(0.54, num_tokens=504, num_decoding=4)  # 500 prompt tokens in 0.5 s
    assert rates.prefill_tokens_per_s == pytest.approx(1000.0)  # large: ratio of averages
    rates.observe(0.0, num_tokens=0, num_decoding=0)  # an idle step changes nothing
    assert rates.prefill_tokens_per_s == pytest.approx(1000.0)


def _step_s(prompt_tokens: int) -> float:
    return 0.065 + prompt_tokens / 2000  # a 65 ms fixed cost, then 2,000 tok/s


def test_a_warm_up_of_tiny_prompts_leaves_the_rate_unknown_not_tiny() -> None:
    rates = StepRates()
    for p in (5, 7, 6, 9, 5, 8, 6, 7):  # steps of t = 65 ms + p / 2000
        rates.observe(_step_s(p), num_tokens=p, num_decoding=0)
    # A ratio of averages would read 6.6 / 0.0683 = ~97 tok/s; routers use their default.
    assert rates.prefill_tokens_per_s == 0.0


def test_the_fit_separates_the_fixed_cost_from_the_per_token_cost() -> None:
    rates = StepRates()
    for p in (5, 7, 6, 9):
        rates.observe(_step_s(p), num_tokens=p, num_decoding=0)
    for p in (400, 40, 300, 120):  # spread: sd of the weighted prompt sizes >= 64 tokens
        rates.observe(_step_s(p), num_tokens=p, num_decoding=0)
    assert rates.prefill_tokens_per_s == pytest.approx(2000.0)
    mixed = StepRates()
    mixed.observe(0.04, num_tokens=4, num_decoding=4)  # 10 ms per decoding sequence
    for p in (16, 512, 128):  # each step also decodes 4 sequences (40 ms of it)
        mixed.observe(_step_s(p) + 0.04, num_tokens=p + 4, num_decoding=4)
    assert mixed.prefill_tokens_per_s == pytest.approx(2000.0)


def test_steady_large_steps_use_the_ratio_and_a_skewed_split_is_bounded() -> None:
    rates = StepRates()
    for _ in range(3):  # no spread: the slope is unknown, the ratio of averages counts
        rates.observe(_step_s(512), num_tokens=512, num_decoding=0)
    assert rates.prefill_tokens_per_s == pytest.approx(512 / 0.321)
    skewed = StepRates()
    skewed.observe(1.0, num_tokens=10, num_decoding=10)  # 0.1 s per decoding sequence
    skewed.observe(0.8, num_tokens=310, num_decoding=10)  # decode estimate exceeds the step
    assert skewed.prefill_tokens_per_s == pytest.approx(300 / (MIN_PREFILL_SHARE * 0.8))


def test_a_flat_fit_cannot_publish_a_near_infinite_rate() -> None:
    rates = StepRates()
    # Jitter: the big steps happened to take as long as the small ones (slope ~ 0).
    for p, t in ((20, 0.100), (300, 0.1001), (40, 0.100), (280, 0.1001)):
        rates.observe(t, num_tokens=p, num_decoding=0)
    fit = rates._prefill
    assert rates.prefill_tokens_per_s == pytest.approx(
        MAX_FIT_GAIN * fit.mean_x() / fit.mean_y())
