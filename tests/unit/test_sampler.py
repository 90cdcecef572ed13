"""Sampler: penalty math and logprobs on hand-made logits, with exact expected values.

Values are chosen to be exact in float32 (halves, quarters), so the expectations are exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.worker.penalties import apply_penalties, token_counts
from engine.worker.sampler import Sampler, SamplingRow
from kvfleet.contracts.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0}


def row(prompt=(), output=(), banned=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(
        SamplingParams(**params), generator, tuple(banned), list(prompt), list(output)
    )


def penalise(logits: list[float], prompt=(), output=(), **params) -> list[float]:
    out = apply_penalties(
        torch.tensor([logits]), [SamplingParams(**params)], [list(prompt)], [list(output)]
    )
    return out[0].tolist()


# ---------------------------------------------------------------------------- penalties
def test_token_counts_pad_rows_of_different_lengths():
    counts = token_counts([[1, 1, 3], [], [0]], vocab_size=4)
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_repetition_penalty_covers_prompt_and_output_by_sign():
    logits = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
    got = penalise(logits, prompt=[0, 5], output=[1], repetition_penalty=2.0)
    # 0 (prompt, positive) halved; 1 (output, negative) doubled; 5 (prompt, zero) stays 0;
    # unseen tokens untouched.
    assert got == [1.0, -2.0, 0.5, 3.0, -2.0, 0.0]


def test_repetition_penalty_counts_a_token_once():
    assert penalise([4.0, 4.0], prompt=[0, 0], output=[0, 0], repetition_penalty=2.0) == [
        2.0,
        4.0,
    ]


def test_frequency_and_presence_cover_output_only():
    got = penalise(
        [0.0] * 5, prompt=[0, 0, 4], output=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25
    )
    assert got == [0.0, -1.25, -0.75, 0.0, 0.0]


def test_negative_penalties_reward_repeats():
    got = penalise([1.0, 1.0], output=[0, 0], frequency_penalty=-0.5, presence_penalty=-1.0)
    assert got == [3.0, 1.0]


def test_all_penalties_together_repetition_first():
    got = penalise(
        [3.0, -1.0, 2.0],
        prompt=[2],
        output=[0, 0, 1],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # token 0: 3/2 - 0.5*2 - 0.25; token 1: -1*2 - 0.5 - 0.25; token 2: 2/2 (prompt only).
    assert got == [0.25, -2.75, 1.0]


def test_rows_are_penalised_independently():
    out = apply_penalties(
        torch.tensor([[2.0, 2.0], [2.0, 2.0]]),
        [SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=1.0)],
        [[0], [0]],
        [[], [1]],
    )
    assert out.tolist() == [[1.0, 2.0], [2.0, 1.0]]


def test_banned_token_stays_banned_under_penalties():
    got = penalise(
        [float("-inf"), 1.0], output=[0], repetition_penalty=2.0, frequency_penalty=-2.0
    )
    assert got[0] == float("-inf")


# ---------------------------------------------------------------------------- the sampler
def test_greedy_row_takes_argmax_after_penalties():
    logits = torch.tensor([[5.0, 4.0, 1.0], [5.0, 4.0, 1.0]])
    rows = [row(output=[0], repetition_penalty=2.0, **GREEDY), row(output=[0], **GREEDY)]
    assert Sampler(0)(logits, rows).token_ids == [1, 0]


def test_presence_penalty_moves_greedy_choice():
    logits = torch.tensor([[5.0, 4.5, 1.0]])
    rows = [row(output=[0, 2], presence_penalty=1.0, **GREEDY)]
    assert Sampler(0)(logits, rows).token_ids == [1]


def test_penalties_do_not_touch_other_rows():
    logits = torch.tensor([[1.0, 3.0, 2.0]] * 3)
    rows = [
        row(**GREEDY),
        row(output=[1], frequency_penalty=2.0, **GREEDY),
        row(temperature=1.0, top_k=1),
    ]
    out = Sampler(0)(logits, rows)
    assert out.token_ids == [1, 2, 1]
    assert out.logprobs is None


def test_seeded_row_is_the_same_whatever_else_is_in_the_batch():
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))

    def seeded() -> SamplingRow:
        return row(generator=torch.Generator().manual_seed(11), temperature=0.8)

    alone = [Sampler(0)(logits[:1], [seeded()]).token_ids[0] for _ in range(3)]
    mixed = Sampler(5)(
        logits,
        [
            seeded(),
            row(output=[1, 2], frequency_penalty=1.0, logprobs=3, temperature=1.0),
            row(repetition_penalty=1.2, prompt=[4], logprobs=0, **GREEDY),
            row(temperature=1.0),
        ],
    )
    assert alone == [alone[0]] * 3
    assert mixed.token_ids[0] == alone[0]


# ---------------------------------------------------------------------------- logprobs
def log_softmax(values: list[float]) -> list[float]:
    total = math.log(sum(math.exp(v) for v in values))
    return [v - total for v in values]


def test_logprobs_are_raw_sampled_rank_and_top_k_most_likely_first():
    values = [1.0, 3.0, 2.0, 0.0, 2.5]
    expected = log_softmax(values)
    # The penalty, the ban and the greedy choice change the sampled token, not the logprobs.
    rows = [row(output=[1], banned=[4], repetition_penalty=4.0, logprobs=3, **GREEDY)]
    out = Sampler(0)(torch.tensor([values]), rows)
    assert out.token_ids == [2]
    assert out.logprobs is not None
    token = out.logprobs[0]
    assert token is not None
    assert (token.sampled.token_id, token.sampled.rank) == (2, 3)
    assert token.sampled.logprob == pytest.approx(expected[2], abs=1e-6)
    assert [(t.token_id, t.rank) for t in token.top] == [(1, 1), (4, 2), (2, 3)]
    for t in token.top:
        assert t.logprob == pytest.approx(expected[t.token_id], abs=1e-6)


def test_logprobs_ignore_temperature():
    values = [0.0, 1.0, 2.0]
    rows = [row(temperature=0.25, top_k=1, logprobs=1)]
    token = Sampler(0)(torch.tensor([values]), rows).logprobs[0]  # type: ignore[index]
    assert token is not None
    assert token.sampled == token.top[0]
    assert (token.sampled.token_id, token.sampled.rank) == (2, 1)
    assert token.sampled.logprob == pytest.approx(log_softmax(values)[2], abs=1e-6)


def test_logprobs_zero_gives_only_the_sampled_token():
    rows = [row(logprobs=0, **GREEDY)]
    token = Sampler(0)(torch.tensor([[0.0, 1.0]]), rows).logprobs[0]  # type: ignore[index]
    assert token is not None
    assert token.top == ()
    assert (token.sampled.token_id, token.sampled.rank) == (1, 1)


def test_rank_counts_strictly_larger_logprobs_only():
    # Tokens 0 and 2 tie for best; the ban makes the greedy pick token 2 even so.
    rows = [row(banned=[0], logprobs=2, **GREEDY)]
    token = Sampler(0)(torch.tensor([[2.0, 1.0, 2.0]]), rows).logprobs[0]  # type: ignore[index]
    assert token is not None
    assert (token.sampled.token_id, token.sampled.rank) == (2, 1)
    assert [t.rank for t in token.top] == [1, 2]
    assert {t.token_id for t in token.top} == {0, 2}


def test_only_rows_that_ask_get_logprobs_with_their_own_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    rows = [row(logprobs=1, **GREEDY), row(**GREEDY), row(logprobs=3, **GREEDY)]
    out = Sampler(0)(logits, rows)
    assert out.logprobs is not None
    first, none, third = out.logprobs
    assert none is None
    assert first is not None and third is not None
    assert [t.token_id for t in first.top] == [3]
    assert [t.token_id for t in third.top] == [3, 2, 1]


def test_greedy_ties_take_the_first_maximum_like_argmax():
    logits = torch.zeros(2, 50)
    logits[0, [7, 30]] = 2.0
    logits[1, [3, 4, 49]] = 1.0
    out = Sampler(0)(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert out.token_ids == [7, 3]
