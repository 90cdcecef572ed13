"""engine.models.linear / gemm_select: every CPU GEMM backend computes F.linear (to float32
rounding: only the blocking differs), and the start-up choice is one of the measured ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.models.linear as linear_module
from engine.models import gemm_select
from engine.models.gemm_select import choose_backend
from engine.models.linear import BACKENDS, Linear, backend_supported


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
def test_backend_equals_f_linear(backend: str, rows: int) -> None:
    if not backend_supported(backend, torch.float32):
        pytest.skip(f"{backend} has no float32 path on this machine")
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(96, 80, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=gen))
        layer.bias.copy_(torch.randn(80, generator=gen))
    layer.prepack(backend)
    x = torch.randn(rows, 96, generator=gen)
    with torch.inference_mode():
        got = layer(x)
    expected = F.linear(x, layer.weight, layer.bias)
    assert got.shape == (rows, 80)
    # Sums of 96 products of N(0,1) values: float32 reassociation moves them by ~1e-5.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_bfloat16_onednn_close_to_dense() -> None:
    if not backend_supported("onednn", torch.bfloat16):
        pytest.skip("oneDNN not built into this torch")
    gen = torch.Generator().manual_seed(0)
    layer = Linear(64, 48, bias=False).to(torch.bfloat16)
    layer.prepack("onednn")
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x).float()
    expected = F.linear(x.float(), layer.weight.float())
    # bfloat16 output rounding (8 bits of mantissa) dominates.
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_auto_measures_every_supported_backend() -> None:
    layers = [[torch.randn(48, 32), torch.randn(32, 48)] for _ in range(3)]
    choice = choose_backend(layers, torch.randn(100, 32), "auto", repeats=1, prefill_rows=200)
    expected = {b for b in BACKENDS if backend_supported(b, torch.float32)}
    assert set(choice.scores) == set(choice.prefill_scores) == set(choice.head_scores) == expected
    assert choice.backend == min(choice.scores, key=lambda b: choice.scores[b])
    assert choice.lm_head == min(choice.head_scores, key=lambda b: choice.head_scores[b])


def test_forced_backend_is_used_and_unknown_refused() -> None:
    assert choose_backend([[torch.randn(4, 4)]], torch.randn(8, 4), "dense").backend == "dense"
    with pytest.raises(ValueError, match="unknown linear backend"):
        choose_backend([[torch.randn(4, 4)]], torch.randn(8, 4), "blas")


def test_dense_above_runs_large_batches_on_the_dense_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = next(b for b in ("panel", "mkl", "onednn") if backend_supported(b, torch.float32))
    gen = torch.Generator().manual_seed(3)
    layer = Linear(64, 40, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 64, generator=gen))
    layer.prepack(backend, dense_above=8)
    dense_calls: list[int] = []
    real = F.linear
    # Spies on F.linear: the packed path calls its op directly (Linear._set_direct).
    monkeypatch.setattr(F, "linear", lambda x, *a: dense_calls.append(x.shape[0]) or real(x, *a))
    with torch.inference_mode():
        small, large = layer(torch.randn(8, 64)), layer(torch.randn(9, 64))
    assert small.shape == (8, 40) and large.shape == (9, 40)
    assert dense_calls == [9]  # 8 rows ran on the packed weight


def _fake_times(monkeypatch: pytest.MonkeyPatch, fake: dict[str, dict[str, list[float]]],
                seen_rows: list[int] | None = None) -> None:
    monkeypatch.setattr(gemm_select, "BACKENDS", tuple(fake))
    monkeypatch.setattr(gemm_select, "backend_supported", lambda b, dtype: True)

    def scores(c: list[str], w: object, h: object, r: int, rows: int) -> object:
        if seen_rows is not None:
            seen_rows.append(rows)
        return {b: fake[b] for b in c}

    monkeypatch.setattr(gemm_select, "_scores", scores)


def test_choice_uses_dense_above_only_when_f_linear_wins_prefill_by_the_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = {"dense": {"decode": [3.0, 3.0, 3.0], "head": [5.0], "prefill": [1.0, 1.0]},
            "panel": {"decode": [1.0, 1.0, 1.0], "head": [4.0], "prefill": [2.0, 2.0]}}
    rows: list[int] = []
    _fake_times(monkeypatch, fake, rows)
    weights = [[torch.randn(4, 4), torch.randn(4, 4)]]
    choice = choose_backend(weights, torch.randn(8, 4), prefill_rows=512)
    assert (choice.backend, choice.dense_above) == ("panel", gemm_select.DENSE_ABOVE_ROWS)
    assert choice.scores == {"dense": 9.0, "panel": 3.0}
    assert choice.prefill_scores == {"dense": 2.0, "panel": 4.0}
    fake["dense"]["prefill"] = [1.95, 1.95]  # 3.9 vs 4.0: within the margin, one GEMM path
    assert choose_backend(weights, torch.randn(8, 4), prefill_rows=8192).dense_above is None
    # Prefill shapes are measured at the engine's budget, capped, and always above the
    # dense_above threshold they decide.
    choose_backend(weights, torch.randn(8, 4), prefill_rows=16)
    assert rows == [512, gemm_select.MAX_PREFILL_ROWS, gemm_select.DENSE_ABOVE_ROWS + 1]


def test_the_lm_head_takes_its_own_fastest_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head is one GEMM a step against the layers' dozens: each group is scored alone."""
    fake = {"mkl": {"decode": [2.0, 2.0], "head": [9.0], "prefill": [5.0]},
            "panel": {"decode": [1.5, 1.5], "head": [11.0], "prefill": [5.0]},
            "dense": {"decode": [3.0, 3.0], "head": [12.0], "prefill": [5.0]}}
    _fake_times(monkeypatch, fake)
    choice = choose_backend([[torch.randn(4, 4)]], torch.randn(8, 4))
    assert (choice.backend, choice.lm_head, choice.dense_above) == ("panel", "mkl", None)
    assert choice.head_scores == {"mkl": 9.0, "panel": 11.0, "dense": 12.0}
    assert choose_backend([[torch.randn(4, 4)]], torch.randn(8, 4), "dense").lm_head == "dense"


def test_the_decode_sweep_covers_twice_the_last_level_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode steps read their weights from DRAM: the sweep must not fit in cache."""
    layers = [[torch.zeros(256, 256)] for _ in range(10)]  # 256 KiB a layer
    monkeypatch.setattr(gemm_select, "_cache_bytes", lambda: 1 << 20)
    assert gemm_select.sweep_layers(layers) == 8
    monkeypatch.setattr(gemm_select, "_cache_bytes", lambda: 64 << 20)
    assert gemm_select.sweep_layers(layers) == 10  # all there are
    monkeypatch.setattr(gemm_select, "_cache_bytes", lambda: 1)
    assert gemm_select.sweep_layers(layers) == 1


def test_start_up_measurements_leave_the_global_rng_alone() -> None:
    """Seeded sampling draws from torch's global generator; the start-up GEMM timing and the
    AMX probe run before the first request and must not move it."""
    layers = [[torch.randn(48, 32), torch.randn(32, 48)]]
    head = torch.randn(100, 32)
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    choose_backend(layers, head, "auto", repeats=1, prefill_rows=200)
    choose_backend([[w.bfloat16() for w in layers[0]]], head.bfloat16(), "auto", repeats=1,
                   prefill_rows=200)
    linear_module._amx_state.clear()
    linear_module.amx_supported()
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("gate_up", [False, True])
def test_direct_call_equals_the_general_path(gate_up: bool) -> None:
    """Linear.forward's direct op call (set at prepack) gives the general path's bits."""
    if not backend_supported("panel", torch.float32):
        pytest.skip("panel kernel not built")
    gen = torch.Generator().manual_seed(5)
    layer = Linear(64, 64, bias=not gate_up)
    layer.gate_up_inter = 32 if gate_up else 0
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 64, generator=gen))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(64, generator=gen))
    layer.prepack("panel")
    assert layer._direct_op is not None and layer.interleaved == gate_up
    x = torch.randn(3, 64, generator=gen)
    with torch.inference_mode():
        direct = layer(x)
        general = (layer._gate_up(x, "none") if gate_up else
                   linear_module.apply_linear(x, layer.weight, layer.bias, "panel",
                                              layer.packed_weight))
    assert torch.equal(direct, general)
