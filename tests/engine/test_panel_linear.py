"""kernels/cpu/panel_linear.cpp through engine.models.linear: the panel-packed GEMM equals
F.linear on the shapes that stress its edges — a last panel with 1..31 real columns, odd K,
row counts that leave partial 12-row tiles, several row blocks, and x given as a strided view."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.linear import backend_supported, pack_panels, panel_linear

pytestmark = pytest.mark.skipif(
    not backend_supported("panel", torch.float32), reason="CPU kernels not built here"
)


def _case(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)


@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [(1, 64, 32), (5, 97, 33), (12, 64, 63), (13, 576, 960), (31, 31, 7), (40, 1536, 65),
     # K = 4096: 32 rows per L2 block, so 100 rows run four blocks.
     (100, 4096, 40)],
)
def test_float32_equals_f_linear(rows: int, k: int, n: int) -> None:
    x, w = _case(rows, k, n, seed=rows + k + n)
    got = panel_linear(x, pack_panels(w), n, None)
    # float32 sums of k products of N(0,1) values, in another order than MKL's: the two
    # differ by a few ulps of the partial sums (~sqrt(k) * 1e-7 relative).
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=2e-4 * (k / 576) ** 0.5)


def test_strided_input_and_bias() -> None:
    base, w = _case(9, 200, 50, seed=3)
    x = base[:, 8:136]  # rows 200 apart, 128 wide
    bias = torch.randn(50)
    got = panel_linear(x, pack_panels(w[:, :128].contiguous()), 50, bias)
    torch.testing.assert_close(got, F.linear(x, w[:, :128], bias), rtol=1e-5, atol=2e-4)


def test_packed_layout_is_columns_by_panel() -> None:
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # N = 40, K = 3
    packed = pack_panels(w)
    assert packed.shape == (2, 3, 32)
    assert torch.equal(packed[0, 1], w[:32, 1])  # panel 0, k = 1: columns 0..31
    assert torch.equal(packed[1, 2, :8], w[32:, 2])
    assert not packed[1, :, 8:].any()  # zero padding past N


@pytest.mark.skipif(not backend_supported("panel", torch.bfloat16),
                    reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 32), (7, 97, 33), (32, 576, 960),
                                              (45, 1536, 70)])
def test_bfloat16_close_to_float32_reference(rows: int, k: int, n: int) -> None:
    x, w = _case(rows, k, n, seed=k)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = panel_linear(xb, pack_panels(wb), n, None)
    assert got.dtype == torch.bfloat16
    expected = F.linear(xb.float(), wb.float())
    # Exact bf16 products summed in float32, then one rounding to bfloat16 (8-bit mantissa):
    # within half a bf16 ulp of the float32 result, plus float32 summation noise.
    scale = expected.abs().clamp_min(1.0)
    assert ((got.float() - expected).abs() / scale).max().item() < 2 ** -8 + 1e-4


@pytest.mark.skipif(not backend_supported("panel", torch.bfloat16),
                    reason="no AVX512-BF16 on this CPU")
def test_bfloat16_layout_pairs_k() -> None:
    w = torch.arange(33 * 5, dtype=torch.float32).view(33, 5).bfloat16()  # odd K
    packed = pack_panels(w)
    assert packed.shape == (2, 3, 64)
    # panel 0, pair 1 = k 2 and 3 of column 0, then of column 1.
    assert packed[0, 1, :4].tolist() == [w[0, 2].item(), w[0, 3].item(),
                                         w[1, 2].item(), w[1, 3].item()]
    assert packed[0, 2, 1].item() == 0  # K padded to even with zeros
