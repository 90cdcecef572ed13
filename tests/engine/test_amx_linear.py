"""kernels/cpu/amx_linear.cpp through engine.models.linear: the AMX tile GEMM computes exact
bfloat16 products summed in float32 (then rounded once to bfloat16, or kept in float32), on
the shapes that stress its edges — partial 16-row blocks, a K that is not a multiple of 32, a
last panel with few real columns, several 256-row units, strided x, bias; and gemm_select
offers it only for bfloat16 where it runs. Skipped on CPUs without AMX (the op is not built)."""

from __future__ import annotations

import pytest
import torch

from engine.models.gemm_select import choose_backend
from engine.models.linear import Linear, amx_linear, amx_supported, backend_supported, pack_amx

pytestmark = pytest.mark.skipif(not amx_supported(), reason="needs a CPU with AMX")


def _case(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen).to(torch.bfloat16),
            torch.randn(n, k, generator=gen).to(torch.bfloat16))


def _exact(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact dot products (float64 of exact bf16 products) and a float32-summation bound
    for any order of K sums: K float32 ulps of the sum of the products' magnitudes."""
    xd, wd = x.double(), w.double()
    return xd @ wd.T, x.shape[1] * 2.0**-24 * (xd.abs() @ wd.abs().T)


SHAPES = [(1, 32, 32), (3, 40, 50), (16, 576, 960), (17, 576, 3072), (31, 1536, 576),
          (32, 64, 7), (45, 100, 100), (300, 96, 65)]


@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
def test_float32_out_is_an_exact_product_sum(rows: int, k: int, n: int) -> None:
    x, w = _case(rows, k, n, seed=rows + k + n)
    got = amx_linear(x, pack_amx(w), n, None, out_dtype=torch.float32)
    exact, bound = _exact(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
def test_bfloat16_out_is_the_float32_sum_rounded_once(rows: int, k: int, n: int) -> None:
    x, w = _case(rows, k, n, seed=7 * rows + k)
    packed = pack_amx(w)
    got = amx_linear(x, packed, n, None)
    sums = amx_linear(x, packed, n, None, out_dtype=torch.float32)
    assert got.dtype == torch.bfloat16
    # Same float32 sums (same kernel, same order), rounded to nearest even by one conversion.
    assert torch.equal(got, sums.to(torch.bfloat16))


def test_strided_input_bias_and_empty_batch() -> None:
    base, w = _case(20, 200, 70, seed=3)
    x = base[:, 8:136]  # rows 200 apart, 128 wide
    w = w[:, :128].contiguous()
    bias = torch.randn(70).to(torch.bfloat16)
    got = amx_linear(x, pack_amx(w), 70, bias, out_dtype=torch.float32)
    exact, bound = _exact(x, w)
    assert bool(((got.double() - bias.double() - exact).abs() <= bound + 1e-6).all())
    assert amx_linear(x[:0], pack_amx(w), 70, None).shape == (0, 70)


def test_offered_for_bfloat16_only() -> None:
    assert backend_supported("amx", torch.bfloat16)
    assert not backend_supported("amx", torch.float32)


def test_a_linear_layer_packed_for_amx_matches_its_float32_sums() -> None:
    layer = Linear(96, 80, bias=False).to(torch.bfloat16)
    layer.prepack("amx")
    x = torch.randn(37, 96).to(torch.bfloat16)
    exact, bound = _exact(x, layer.weight.detach())
    # One bfloat16 rounding of a sum within `bound`: half a bf16 ulp (2^-8 relative) more.
    err = (layer(x).double() - exact).abs()
    assert bool((err <= bound + 2.0**-8 * exact.abs() + 1e-30).all())


def test_auto_choice_measures_amx_beside_the_others() -> None:
    gen = torch.Generator().manual_seed(0)
    layers = [[(torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
               for n, k in ((96, 64), (64, 64), (256, 64), (64, 128))]]
    head = torch.randn(512, 64, generator=gen).to(torch.bfloat16)
    choice = choose_backend(layers, head, prefill_rows=256)
    assert "amx" in choice.scores and "amx" in choice.head_scores
    assert choice.scores[choice.backend] == min(choice.scores.values())
