"""Greedy argmax under a final logit soft-cap (Gemma 2) without capping the whole vocabulary:
the screened LM head and the full-logits screen return the first maximum of the capped
logits, including ties that only the cap's float32 rounding creates; a saturated cap or a
non-finite logit falls back; Gemma 2 end to end takes these paths and keeps the sampler's
tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.greedy_screen import GreedyScreen, capped_greedy, screen_supported
from engine.models.linear import pack_panels, panel_linear
from tests.fixtures.greedy import assert_fast_greedy_matches_sampler

pytestmark = pytest.mark.skipif(
    not screen_supported(torch.zeros(1, 1), "panel"),
    reason="needs the CPU kernels with AVX512-BF16",
)


def _capped(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """compute_logits' cap, on a copy of the full logits."""
    return logits.clone().div_(cap).tanh_().mul_(cap)


def _full_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return panel_linear(hidden, pack_panels(weight), weight.shape[0], None)


def _expected(hidden: torch.Tensor, weight: torch.Tensor, cap: float) -> list[int]:
    return _capped(_full_logits(hidden, weight), cap).max(dim=-1).indices.tolist()


def _lm_head(vocab: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, k, generator=gen) * torch.rand(vocab, 1, generator=gen) * 0.3


@pytest.mark.parametrize("cap", [30.0, 10.0, 5.0])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_capped_screen_equals_full_capped_argmax(rows: int, cap: float) -> None:
    weight = _lm_head(4099, 192, seed=rows)
    hidden = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows + 50)) * 1.5
    expected = _expected(hidden, weight, cap)
    assert GreedyScreen(weight).argmax(hidden, cap) == expected
    assert capped_greedy(_full_logits(hidden, weight), cap) == expected


def _cap_tie(weight: torch.Tensor, hidden: torch.Tensor, cap: float) -> int:
    """Copies row 0's winner into token 3, scaled down as far as its logit still caps to the
    winner's value; returns the winner."""
    winner = int(_full_logits(hidden, weight)[0].argmax())
    best = None
    for step in range(1, 4000, 9):
        weight[3] = weight[winner] * (1 - step * 2.0**-24)
        logits = _full_logits(hidden, weight)[0]
        if _capped(logits[None], cap)[0, 3] == _capped(logits[None], cap)[0, winner]:
            best = weight[3].clone()
    assert best is not None, "no cap-induced tie found"
    weight[3] = best
    return winner


def test_tie_made_by_the_cap_takes_the_first_token() -> None:
    """Token 3's logit is below the winner's by more than the screen's own float32 slack, so
    the uncapped argmax is the winner, but both cap to one float32 value: the capped argmax
    (transformers' greedy) is token 3."""
    cap = 2.0
    weight = _lm_head(2048, 64, seed=11)
    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(12))
    # Logits near 6 caps, where tanh is flat: one capped value spans many float32 logits.
    hidden *= 12.0 / float(_full_logits(hidden, weight).max())
    winner = _cap_tie(weight, hidden, cap)
    logits = _full_logits(hidden, weight)
    assert logits.argmax(dim=-1).tolist() == [winner]
    top = float(logits[0, winner])
    assert top - float(logits[0, 3]) > 2e-5 * (1 + top)  # beyond screen_candidates' kSlack
    assert _expected(hidden, weight, cap) == [3]
    assert GreedyScreen(weight).argmax(hidden, cap) == [3]
    assert capped_greedy(logits, cap) == [3]


def test_saturated_cap_and_non_finite_logits_fall_back() -> None:
    weight = _lm_head(1024, 64, seed=13)
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(14)) * 4
    # tanh is flat at 1 across the row's top logits: everything could tie, nothing to screen.
    assert GreedyScreen(weight).argmax(hidden, 0.01) is None
    assert capped_greedy(_full_logits(hidden, weight), 0.01) is None
    logits = _full_logits(hidden, weight)
    logits[1, 5] = float("nan")
    assert capped_greedy(logits, 30.0) is None
    with pytest.raises(RuntimeError, match="cap must be >= 0"):
        torch.ops.kvfleet_cpu.screen_candidates(logits, torch.zeros(2), torch.zeros(1024), 0.0,
                                                -1.0)


@pytest.mark.parametrize("dtype,backend", [("float32", "panel"), ("float32", "dense"),
                                           ("bfloat16", "dense")])
def test_gemma2_capped_greedy_rows_match_the_sampler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, backend: str
) -> None:
    """Plain greedy rows of the tiny Gemma 2 (final cap 1.0) take the capped screen (float32
    panel head) or the full-logits screen, and decode what the sampler's argmax over every
    capped logit decodes."""
    from engine import LLM
    from engine.models import greedy_screen
    from tests.fixtures.family_models import build_family_dir

    llm = LLM(str(build_family_dir(tmp_path, "gemma2")), dtype=dtype, linear_backend=backend)
    assert (llm.engine.runner.model._greedy_screen is not None) is (backend == "panel")
    calls: list[int] = []
    real = greedy_screen.capped_argmax
    monkeypatch.setattr(greedy_screen, "capped_argmax",
                        lambda exact, ids, cap: calls.append(len(ids)) or real(exact, ids, cap))
    assert_fast_greedy_matches_sampler(llm, monkeypatch, calls)
