"""kernels/cpu/panel_gate_up through engine.models.linear: on gate/up interleaved panels the
projection equals the plain panel GEMM bit for bit, and its fused SiLU-and-mul equals the
unfused kernel's (GEMM, then kvfleet_cpu::silu_and_mul) bit for bit; the MLP takes the fused
path only where it may."""

from __future__ import annotations

import pytest
import torch

from engine.models.linear import (
    Linear,
    backend_supported,
    pack_gate_up_panels,
    pack_panels,
    panel_linear,
)

pytestmark = pytest.mark.skipif(
    not backend_supported("panel", torch.float32), reason="CPU kernels not built here"
)


def _case(rows: int, k: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen), torch.randn(2 * inter, k, generator=gen) * 0.1


def test_interleaved_layout() -> None:
    inter, k = 32, 3
    w = torch.arange(2 * inter * k, dtype=torch.float32).view(2 * inter, k)
    packed = pack_gate_up_panels(w)
    assert packed.shape == (2, k, 32)
    assert torch.equal(packed[1, 2, :16], w[16:32, 2])  # gate columns 16..31
    assert torch.equal(packed[1, 2, 16:], w[inter + 16 : inter + 32, 2])  # their up columns


@pytest.mark.parametrize(("rows", "k", "inter"), [(1, 64, 16), (13, 97, 48), (64, 576, 1536),
                                                  (300, 576, 160)])
def test_split_output_equals_plain_gemm(rows: int, k: int, inter: int) -> None:
    x, w = _case(rows, k, inter, seed=rows + k)
    out = torch.empty(rows, 2 * inter)
    torch.ops.kvfleet_cpu.panel_gate_up(out, x, pack_gate_up_panels(w), inter, False)
    # Each output is the same FMA chain over k whatever panel holds its column.
    assert torch.equal(out, panel_linear(x, pack_panels(w), 2 * inter, None))


@pytest.mark.parametrize(("rows", "k", "inter"), [(1, 64, 16), (13, 97, 48), (64, 576, 1536),
                                                  (300, 576, 160)])
def test_fused_silu_equals_unfused_kernels(rows: int, k: int, inter: int) -> None:
    x, w = _case(rows, k, inter, seed=rows * 7 + k)
    fused = torch.empty(rows, inter)
    torch.ops.kvfleet_cpu.panel_gate_up(fused, x, pack_gate_up_panels(w), inter, True)
    gate_up = panel_linear(x, pack_panels(w), 2 * inter, None)
    unfused = torch.empty(rows, inter)
    torch.ops.kvfleet_cpu.silu_and_mul(unfused, gate_up)
    assert torch.equal(fused, unfused)


def test_linear_packs_interleaved_only_where_it_can() -> None:
    layer = Linear(64, 2 * 48, bias=False)
    layer.gate_up_inter = 48
    layer.prepack("panel")
    assert layer.interleaved
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), panel_linear(x, pack_panels(layer.weight.detach()), 96, None))
    act = layer.silu_and_mul(x)
    assert act is not None and act.shape == (5, 48)
    odd = Linear(64, 2 * 40, bias=False)  # 40 is not a multiple of 16
    odd.gate_up_inter = 40
    odd.prepack("panel")
    assert not odd.interleaved and odd.silu_and_mul(x) is None
    plain = Linear(64, 96, bias=False)  # not a gate/up projection
    plain.prepack("panel")
    assert not plain.interleaved
    other = Linear(64, 96, bias=False)
    other.gate_up_inter = 48
    other.prepack("onednn" if backend_supported("onednn", torch.float32) else "dense")
    assert not other.interleaved
