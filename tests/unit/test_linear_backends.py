"""engine.models.linear / gemm_select: every CPU GEMM backend computes F.linear (to float32
rounding: only the blocking differs), and the start-up choice is one of the measured ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.gemm_select import choose_backend
from engine.models.linear import BACKENDS, Linear, backend_supported


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
def test_backend_equals_f_linear(backend: str, rows: int) -> None:
    if not backend_supported(backend, torch.float32):
        pytest.skip(f"{backend} not built into this torch")
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
    weights = [torch.randn(48, 32), torch.randn(32, 48)]
    choice = choose_backend(weights, torch.randn(100, 32), "auto", repeats=1)
    expected = {b for b in BACKENDS if backend_supported(b, torch.float32)}
    assert set(choice.scores) == expected
    assert choice.backend == min(choice.scores, key=lambda b: choice.scores[b])


def test_forced_backend_is_used_and_unknown_refused() -> None:
    assert choose_backend([torch.randn(4, 4)], torch.randn(8, 4), "dense").backend == "dense"
    with pytest.raises(ValueError, match="unknown linear backend"):
        choose_backend([torch.randn(4, 4)], torch.randn(8, 4), "blas")
