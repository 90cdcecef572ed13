"""The rejection sampler alone: emitted tokens follow the target distribution.

Chi-square goodness of fit at significance 0.001 (critical value for 5 degrees of freedom:
20.515) over fixed target/draft distributions on a 6-token vocabulary, k = 3 drafts, so
positions 1-3 (drafts kept or corrected) and position 4 (the bonus token) are all tested.
Every draw comes from seeded generators, so the test gives the same statistics every run and
cannot flake. Position j is tested over the trials that reached it (the first j - 1 drafts
kept): the drafts and draws of later positions are independent of earlier ones, so a correct
sampler gives x_j ~ p_j there too. A control shows the test has power: emitting the drafts
unverified fails it.
"""

from __future__ import annotations

import torch

from engine.spec_decode.rejection_sampler import greedy_verify, rejection_sample

VOCAB = 6
NUM_DRAFTS = 3
TRIALS = 12_000
CHI2_CRITICAL_DF5_P001 = 20.515


def _distributions(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 0.8
    return logits.softmax(dim=-1)


TARGET = _distributions(1, NUM_DRAFTS + 1)
# Near the target (so enough trials reach the bonus position) but clearly not equal to it.
DRAFT = 0.5 * TARGET[:NUM_DRAFTS] + 0.5 * _distributions(2, NUM_DRAFTS)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _positions(samples: list[list[int]]) -> list[torch.Tensor]:
    counts = [torch.zeros(VOCAB, dtype=torch.float64) for _ in range(NUM_DRAFTS + 1)]
    for tokens in samples:
        for j, token in enumerate(tokens):
            counts[j][token] += 1
    return counts


def _run(draft_probs: torch.Tensor | None, fixed_drafts: list[int] | None) -> list[list[int]]:
    proposal = torch.Generator().manual_seed(10)
    verifier = torch.Generator().manual_seed(11)
    samples = []
    for _ in range(TRIALS):
        if fixed_drafts is None:
            assert draft_probs is not None
            drafts = torch.multinomial(draft_probs, 1, generator=proposal).flatten().tolist()
        else:
            drafts = fixed_drafts
        tokens = rejection_sample(TARGET, drafts, draft_probs, verifier)
        assert 1 <= len(tokens) <= NUM_DRAFTS + 1
        assert tokens[:-1] == drafts[: len(tokens) - 1]
        samples.append(tokens)
    return samples


def test_sampled_drafts_give_the_target_distribution_at_every_position():
    counts = _positions(_run(DRAFT, None))
    for j in range(NUM_DRAFTS + 1):
        # Enough trials reach each position for the expected counts to be large (>= 5 each).
        assert float(counts[j].sum()) * float(TARGET[j].min()) >= 5, j
        assert _chi_square(counts[j], TARGET[j].double()) < CHI2_CRITICAL_DF5_P001, j
    assert counts[NUM_DRAFTS].sum() > 0  # the bonus token was drawn


def test_deterministic_drafts_give_the_target_distribution():
    # An n-gram-like proposer: the same drafts every time, q = one-hot.
    drafts = [int(TARGET[j].argmax()) for j in range(NUM_DRAFTS)]
    counts = _positions(_run(None, drafts))
    for j in range(NUM_DRAFTS + 1):
        assert _chi_square(counts[j], TARGET[j].double()) < CHI2_CRITICAL_DF5_P001, j


def test_unverified_drafts_fail_the_test():
    """Control: the drafts themselves are far from the target, so the test can fail."""
    g = torch.Generator().manual_seed(10)
    drafts = torch.multinomial(DRAFT[0], TRIALS, replacement=True, generator=g)
    counts = torch.bincount(drafts, minlength=VOCAB).double()
    assert _chi_square(counts, TARGET[0].double()) > 10 * CHI2_CRITICAL_DF5_P001


def test_same_seed_same_tokens():
    def draw(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [rejection_sample(TARGET, [0, 1, 2], DRAFT, g) for _ in range(50)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_greedy_verify_accepts_the_matching_prefix_then_corrects():
    assert greedy_verify([7, 8, 9, 4], [7, 8, 9]) == [7, 8, 9, 4]  # all kept + bonus
    assert greedy_verify([7, 5, 9, 4], [7, 8, 9]) == [7, 5]  # second corrected
    assert greedy_verify([3, 8, 9, 4], [7, 8, 9]) == [3]  # first rejected
    assert greedy_verify([3], []) == [3]


def test_a_draft_the_target_cannot_sample_is_never_kept():
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0], [1 / 6] * 6])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens = rejection_sample(target, [0], None, g)
        assert len(tokens) == 1 and tokens[0] in (1, 2)


def test_drawing_corrections_from_the_target_instead_of_the_residual_fails(monkeypatch):
    """Control: a subtle bug (correcting from p, not norm(max(0, p - q))) is caught."""
    import engine.spec_decode.rejection_sampler as module

    monkeypatch.setattr(module, "_residual", lambda p, token, q: p)
    counts = _positions(_run(DRAFT, None))
    assert _chi_square(counts[0], TARGET[0].double()) > CHI2_CRITICAL_DF5_P001
