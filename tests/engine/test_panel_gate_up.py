"""kernels/cpu/panel_gate_up through engine.models.linear: on gate/up interleaved panels the
projection equals the plain panel GEMM bit for bit, and its fused SiLU-and-mul and GeGLU equal
the unfused kernels' (GEMM, then kvfleet_cpu::silu_and_mul / gelu_tanh_and_mul) bit for bit;
the MLP takes the fused path only where it may."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


# (rows, k, inter): one row, shapes off every block size, SmolLM2's MLP, a prefill-sized batch.
SHAPES = [(1, 64, 16), (13, 97, 48), (64, 576, 1536), (300, 576, 160)]


@pytest.mark.parametrize(("rows", "k", "inter"), SHAPES)
def test_split_output_equals_plain_gemm(rows: int, k: int, inter: int) -> None:
    x, w = _case(rows, k, inter, seed=rows + k)
    out = torch.empty(rows, 2 * inter)
    torch.ops.kvfleet_cpu.panel_gate_up(out, x, pack_gate_up_panels(w), inter, "none")
    # Each output is the same FMA chain over k whatever panel holds its column.
    assert torch.equal(out, panel_linear(x, pack_panels(w), 2 * inter, None))


def _gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.kvfleet_cpu.gelu_tanh_and_mul(out, gate_up)
    return out


# The epilogue's unfused kernel (silu_and_mul allocates its output; gelu_tanh_and_mul writes
# the one it is given), and PyTorch's expression of it.
ACTS = {
    "silu": (lambda gate_up: torch.ops.kvfleet_cpu.silu_and_mul(gate_up),
             lambda g, u: F.silu(g) * u),
    "gelu_tanh": (_gelu_tanh_and_mul, lambda g, u: F.gelu(g, approximate="tanh") * u),
}


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize(("rows", "k", "inter"), SHAPES)
def test_fused_act_equals_unfused_kernels(act: str, rows: int, k: int, inter: int) -> None:
    unfused_op, reference = ACTS[act]
    x, w = _case(rows, k, inter, seed=rows * 7 + k)
    x[0] *= 8.0  # row 0's gates reach the activation's far tails
    fused = torch.empty(rows, inter)
    torch.ops.kvfleet_cpu.panel_gate_up(fused, x, pack_gate_up_panels(w), inter, act)
    gate_up = panel_linear(x, pack_panels(w), 2 * inter, None)
    assert torch.equal(fused, unfused_op(gate_up))
    expected = reference(gate_up[:, :inter], gate_up[:, inter:])
    assert torch.allclose(fused, expected, rtol=1e-4, atol=1e-5)


def test_unknown_activation_is_refused() -> None:
    x, w = _case(2, 64, 16, seed=1)
    with pytest.raises(RuntimeError, match="panel_gate_up: act must be"):
        torch.ops.kvfleet_cpu.panel_gate_up(torch.empty(2, 16), x, pack_gate_up_panels(w), 16,
                                            "relu")
    layer = Linear(64, 32, bias=False)
    layer.gate_up_inter = 16
    layer.prepack("panel")
    with pytest.raises(ValueError, match="act must be one of silu, gelu_tanh"):
        layer.act_and_mul(x, "relu")


def test_linear_packs_interleaved_only_where_it_can() -> None:
    layer = Linear(64, 2 * 48, bias=False)
    layer.gate_up_inter = 48
    layer.prepack("panel")
    assert layer.interleaved
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), panel_linear(x, pack_panels(layer.weight.detach()), 96, None))
    act = layer.silu_and_mul(x)
    assert act is not None and act.shape == (5, 48)
    assert layer.act_and_mul(x, "gelu_tanh") is None  # not this projection's activation
    layer.gate_up_act = "gelu_tanh"
    geglu = layer.act_and_mul(x, "gelu_tanh")
    assert geglu is not None and geglu.shape == (5, 48)
    gate_up = layer(x)
    assert torch.allclose(geglu, F.gelu(gate_up[:, :48], approximate="tanh") * gate_up[:, 48:],
                          rtol=1e-5, atol=1e-6)
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


BF16_PANELS = hasattr(torch.ops.kvfleet_cpu, "panel_gate_up_bf16")


@pytest.mark.skipif(not BF16_PANELS, reason="no AVX512-BF16 panel kernels on this CPU")
@pytest.mark.parametrize(("rows", "k", "inter"), SHAPES)
def test_bf16_geglu_equals_unfused_kernels(rows: int, k: int, inter: int) -> None:
    x, w = _case(rows, k, inter, seed=rows * 3 + k)
    x[0] *= 8.0  # row 0's gates reach gelu's far tails
    x, w = x.bfloat16(), w.bfloat16()
    packed = pack_gate_up_panels(w)
    assert packed.shape == (inter // 16, (k + 1) // 2, 64)
    split = torch.empty(rows, 2 * inter, dtype=torch.bfloat16)
    torch.ops.kvfleet_cpu.panel_gate_up_bf16(split, x, packed, inter, "none")
    gate_up = panel_linear(x, pack_panels(w), 2 * inter, None)
    assert torch.equal(split, gate_up)
    fused = torch.empty(rows, inter, dtype=torch.bfloat16)
    torch.ops.kvfleet_cpu.panel_gate_up_bf16(fused, x, packed, inter, "gelu_tanh")
    unfused = torch.empty(rows, inter, dtype=torch.bfloat16)
    torch.ops.kvfleet_cpu.gelu_tanh_and_mul(unfused, gate_up)
    assert torch.equal(fused, unfused)


@pytest.mark.skipif(not BF16_PANELS, reason="no AVX512-BF16 panel kernels on this CPU")
def test_bf16_packs_interleaved_for_geglu_only() -> None:
    x = torch.randn(5, 64).bfloat16()
    silu = Linear(64, 96, bias=False).bfloat16()
    silu.gate_up_inter = 48
    silu.prepack("panel")
    assert not silu.interleaved and silu.silu_and_mul(x) is None  # no bfloat16 SiLU epilogue
    geglu = Linear(64, 96, bias=False).bfloat16()
    geglu.gate_up_inter, geglu.gate_up_act = 48, "gelu_tanh"
    geglu.prepack("panel")
    assert geglu.interleaved
    assert torch.equal(geglu(x), panel_linear(x, pack_panels(geglu.weight.detach()), 96, None))
    act = geglu.act_and_mul(x, "gelu_tanh")
    assert act is not None and act.shape == (5, 48) and act.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="act must be 'gelu_tanh' or 'none' in bfloat16"):
        torch.ops.kvfleet_cpu.panel_gate_up_bf16(torch.empty(5, 48, dtype=torch.bfloat16), x,
                                                 geglu.packed_weight, 48, "silu")
