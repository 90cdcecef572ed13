"""engine.models.greedy_screen: the screened argmax is the float32 LM head's argmax, token
for token, including exact ties (first maximum) and near ties closer than bfloat16 can tell
apart; the bfloat16-in, float32-out panel GEMM it screens with; its use by the model runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.greedy_screen import (
    MEASURED_ROWS,
    UNLIMITED,
    GreedyScreen,
    measure_rows_limit,
    rows_limit,
    screen_supported,
)
from engine.models.linear import amx_supported, pack_panels, panel_linear
from tests.fixtures.greedy import assert_fast_greedy_matches_sampler

pytestmark = pytest.mark.skipif(
    not screen_supported(torch.zeros(1, 1), "panel"),
    reason="needs the CPU kernels with AVX512-BF16",
)


# The screen's two bfloat16 GEMMs: the VDPBF16PS panels everywhere here, AMX tiles where the
# CPU has them (the engine's choice there).
SCREEN_GEMMS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not amx_supported(), reason="needs a CPU with AMX"))]


def _full_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> list[int]:
    logits = panel_linear(hidden, pack_panels(weight), weight.shape[0], None)
    return logits.max(dim=-1).indices.tolist()


def _lm_head(vocab: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Embedding-like rows: norms spread over ~1-8, as in SmolLM2's tied LM head.
    return torch.randn(vocab, k, generator=gen) * torch.rand(vocab, 1, generator=gen) * 0.3


@pytest.mark.parametrize("amx", SCREEN_GEMMS)
@pytest.mark.parametrize("rows", [1, 5, 13, 64])
def test_equals_full_argmax(rows: int, amx: bool) -> None:
    weight = _lm_head(4099, 576, seed=rows)
    gen = torch.Generator().manual_seed(100 + rows)
    hidden = torch.randn(rows, 576, generator=gen) * 2
    assert GreedyScreen(weight, use_amx=amx).argmax(hidden) == _full_argmax(hidden, weight)


@pytest.mark.parametrize("amx", SCREEN_GEMMS)
def test_exact_ties_take_the_first_maximum(amx: bool) -> None:
    weight = _lm_head(1000, 64, seed=1)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    # Each row's winner copied to a low id (and a high one): both tie exactly, the low wins.
    for row, token in enumerate(_full_argmax(hidden, weight)):
        weight[row] = weight[token]
        weight[990 + row] = weight[token]
    expected = _full_argmax(hidden, weight)
    assert expected == [0, 1, 2]
    assert GreedyScreen(weight, use_amx=amx).argmax(hidden) == expected


@pytest.mark.parametrize("amx", SCREEN_GEMMS)
def test_near_ties_below_bfloat16_resolution(amx: bool) -> None:
    """Rows that differ from the winner in the last float32 bits: bfloat16 cannot order them,
    the exact pass must."""
    weight = _lm_head(512, 128, seed=3)
    hidden = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    winners = _full_argmax(hidden, weight)
    for i, token in enumerate(winners):
        for j, scale in enumerate((1 - 2e-7, 1 + 2e-7, 1 - 1e-6)):
            weight[100 + 10 * i + j] = weight[token] * scale
    assert GreedyScreen(weight, use_amx=amx).argmax(hidden) == _full_argmax(hidden, weight)


@pytest.mark.parametrize("amx", SCREEN_GEMMS)
def test_candidates_are_few_for_a_peaked_row(amx: bool) -> None:
    """The screen only pays if the bound is tight enough to leave a handful of tokens."""
    weight = _lm_head(8192, 576, seed=5)
    hidden = weight[1234:1235] * 20  # strongly aligned with one token
    screen = GreedyScreen(weight, use_amx=amx)
    approx = screen.approx_logits(hidden)
    h_norm = hidden.double().norm(dim=1).float()
    candidates = torch.ops.kvfleet_cpu.screen_candidates(approx, h_norm, screen.w_norm, screen.c)
    assert 1234 in candidates.tolist()
    assert len(candidates) < 50
    assert screen.argmax(hidden) == [1234]


def test_non_finite_hidden_falls_back() -> None:
    weight = _lm_head(300, 32, seed=6)
    hidden = torch.zeros(2, 32)
    hidden[1, 3] = float("nan")
    assert GreedyScreen(weight).argmax(hidden) is None


@pytest.mark.parametrize("amx", SCREEN_GEMMS)
def test_approx_logits_are_float32_sums_of_bfloat16_products(amx: bool) -> None:
    gen = torch.Generator().manual_seed(8)
    hidden, weight = torch.randn(37, 200, generator=gen), torch.randn(999, 200, generator=gen)
    approx = GreedyScreen(weight, use_amx=amx).approx_logits(hidden)
    exact = hidden.to(torch.bfloat16).double() @ weight.to(torch.bfloat16).double().T
    # float32 sums of 200 exact products: within 200 float32 ulps of their magnitude sum.
    bound = 200 * 2.0**-24 * (hidden.to(torch.bfloat16).double().abs()
                              @ weight.to(torch.bfloat16).double().abs().T)
    assert bool(((approx.double() - exact).abs() <= bound).all())


def test_bfloat16_panel_with_float32_output() -> None:
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(13, 97, generator=gen), torch.randn(45, 97, generator=gen)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    out = torch.empty(13, 45)
    torch.ops.kvfleet_cpu.panel_linear_bf16_f32(out, xb, pack_panels(wb), 45)
    # Exact bfloat16 products summed in float32 (another order than the reference's).
    torch.testing.assert_close(out, xb.float() @ wb.float().T, rtol=1e-5, atol=1e-4)


def test_runner_uses_the_screen_and_matches_full_logits(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same greedy tokens with the screen as with the full float32 logits, and the screen
    really served the plain greedy rows (a logprobs request takes the full path)."""
    from engine import LLM, SamplingParams

    llm = LLM(tiny_model_dir, dtype="float32", linear_backend="panel")
    model = llm.engine.runner.model
    screen = model._greedy_screen
    assert screen is not None
    calls = []
    real = screen.argmax
    monkeypatch.setattr(screen, "argmax", lambda h: calls.append(h.shape[0]) or real(h))
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 77])]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    screened = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls
    monkeypatch.setattr(model, "_greedy_screen", None)
    full = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert screened == full


def test_rows_limit_is_the_last_count_of_an_unbroken_run_of_wins() -> None:
    assert rows_limit({1: (1.0, 2.0), 4: (2.0, 3.0), 16: (5.0, 4.0), 64: (1.0, 9.0)}) == 4
    assert rows_limit({1: (3.0, 2.0), 4: (1.0, 3.0)}) == 0
    assert rows_limit({64: (1.0, 2.0), 1: (1.0, 2.0)}) == 64


def test_measured_limit_is_a_measured_count_and_bounds_the_model_screen(
    tiny_model_dir: Path,
) -> None:
    from engine import LLM

    model = LLM(tiny_model_dir, dtype="float32", linear_backend="panel").engine.runner.model
    screen = model._greedy_screen
    assert screen is not None and screen.max_rows == UNLIMITED  # a forced backend: no timing
    limit = measure_rows_limit(screen, lambda h: model.compute_logits(h).argmax(dim=-1),
                               repeats=1)
    assert limit in (0, *MEASURED_ROWS)
    screen.max_rows = 3
    calls: list[int] = []
    real = screen.argmax
    screen.argmax = lambda h: calls.append(h.shape[0]) or real(h)  # type: ignore[method-assign]
    size = screen.weight.shape[1]
    assert model.greedy_tokens(torch.randn(3, size)) is not None
    # Above the limit: the full LM head and its row argmax, not the screen.
    four = torch.randn(4, size)
    assert model.greedy_tokens(four) == model.compute_logits(four).argmax(dim=-1).tolist()
    assert calls == [3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_torchs_first_maximum(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(12, 3001, generator=gen).to(dtype)
    logits[1, 2000] = logits[1, 30] = logits[1].max() + 1  # exact tie: the first wins
    logits[2, 17] = float("inf")
    logits[3] = float("-inf")
    logits[4] = 0.0
    logits[4, 9] = -0.0  # -0.0 == 0.0: index 0 still comes first
    logits[5, 77] = float("nan")
    ids = torch.ops.kvfleet_cpu.argmax_rows(logits)
    expected = logits.float().max(dim=-1).indices
    assert ids[5].item() == -1  # NaN: the caller falls back to torch's path
    keep = [r for r in range(12) if r != 5]
    assert ids[keep].tolist() == expected[keep].tolist()
    assert ids[1].item() == 30


def test_bfloat16_greedy_rows_take_the_row_argmax_and_match_the_sampler(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 has no screen: plain greedy rows take the bf16 logits' row argmax, the same
    tokens as the sampler's argmax over the upcast logits."""
    from engine import LLM

    llm = LLM(tiny_model_dir, dtype="bfloat16")
    assert llm.engine.runner.model._greedy_screen is None
    calls: list[torch.Size] = []
    real = torch.ops.kvfleet_cpu.argmax_rows
    monkeypatch.setattr(torch.ops.kvfleet_cpu, "argmax_rows",
                        lambda x: calls.append(x.shape) or real(x))
    assert_fast_greedy_matches_sampler(llm, monkeypatch, calls)
