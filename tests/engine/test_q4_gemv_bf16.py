"""The factored bfloat16 kernels for Q4_0 / Q4_1 against x @ W^T with W the exact float32
dequantization (never rounded to bfloat16): the batch-1 kernel (kernels/cpu/quant/
quant_gemv_bf16.h, the op `quant_gemv_bf16`, also what `quant_linear` runs for one bfloat16 row
of a Q4 format) and the factored panel (quant_panel_q4f.h, `quant_linear_panel(...,
factored=True)`, the PANEL_Q4 path) at any row count; the panel-ordered layout's kernel
(quant_panel_q4p.h, `quant_linear_q4p`, the PANEL_Q4P path) equals the factored panel bit for
bit (same integers, same pair order, same float32 scale arithmetic).

Tolerance, stated: |got - ref| <= 2^-8 |ref| + 2^-14 (|x| @ |W|^T). The first term is the
output's one bfloat16 rounding (half an ulp is 2^-9 relative); the second bounds float32
accumulation, including the 128 + q offset's cancellation (~4 bits of 24), with margin.
"""

from __future__ import annotations

import pytest
import torch

from engine.quant import formats
from engine.quant.qlinear import PANEL, PANEL_Q4, PANEL_Q4P, QuantLinear, QuantTensor
from kernels.cpu.quant import load

needs_gemv = pytest.mark.skipif(
    not load() or not torch.ops.kvfleet_quant.quant_has_q4_gemv_bf16(),
    reason="factored bfloat16 kernel not built (needs AVX512_BF16 and AVX512VL)")

Q4 = [formats.Q4_0, formats.Q4_1]


def _weight(qtype: int, n: int, k: int, seed: int, shift: float = 0.0) -> QuantTensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) + shift
    return QuantTensor(formats.quantize(w, qtype), qtype, k)


def _check(qtype: int, n: int, k: int, seed: int, shift: float = 0.0) -> None:
    w = _weight(qtype, n, k, seed, shift)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed + 100)).bfloat16()
    dense = w.dequantize().double()
    ref = x.double() @ dense.T
    scale = x.double().abs() @ dense.abs().T
    for op in ("quant_gemv_bf16", "quant_linear"):
        out = torch.empty(1, n, dtype=torch.bfloat16)
        getattr(torch.ops.kvfleet_quant, op)(out, x, w.raw, qtype)
        err = (out.double() - ref).abs()
        bound = 2**-8 * ref.abs() + 2**-14 * scale
        assert bool((err <= bound).all()), (op, float((err - bound).max()))


@needs_gemv
@pytest.mark.parametrize("qtype", Q4, ids=formats.type_name)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (3, 64), (37, 288), (960, 576), (41, 1536)])
def test_matches_exact_dequantized_weights(qtype, n, k):
    # n: a lone row, fewer than a tile of 4, tiles plus a remainder; k: 1 to 48 blocks.
    _check(qtype, n, k, seed=n + k)


@needs_gemv
def test_large_block_minimum_keeps_precision():
    # Weights far from zero: Q4_1's m dominates d * q, the case where the min term and the
    # 128 + q offset's correction are largest against the result.
    _check(formats.Q4_1, 64, 576, seed=7, shift=20.0)


@needs_gemv
def test_every_nibble_reaches_its_weight():
    # x = one-hot: each output is the one weight it selects, exactly d * q (+ m) up to the
    # bfloat16 rounding; a wrong lane order would pick another weight.
    k = 64
    w = _weight(formats.Q4_1, 5, k, seed=3)
    dense = w.dequantize()
    for i in range(k):
        x = torch.zeros(1, k, dtype=torch.bfloat16)
        x[0, i] = 1.0
        out = torch.empty(1, 5, dtype=torch.bfloat16)
        torch.ops.kvfleet_quant.quant_gemv_bf16(out, x, w.raw, w.qtype)
        assert torch.equal(out[0], dense[:, i].bfloat16()), i


@needs_gemv
def test_refuses_bad_input_naming_it():
    w = _weight(formats.Q4_0, 8, 64, seed=1)
    op = torch.ops.kvfleet_quant.quant_gemv_bf16
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        op(torch.empty(1, 8, dtype=torch.bfloat16), x.float(), w.raw, w.qtype)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        op(torch.empty(2, 8, dtype=torch.bfloat16), x.expand(2, 64).contiguous(), w.raw, w.qtype)
    with pytest.raises(RuntimeError, match="qtype must be Q4_0 or Q4_1"):
        op(torch.empty(1, 8, dtype=torch.bfloat16), x, w.raw, formats.Q8_0)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        op(torch.empty(1, 8, dtype=torch.bfloat16), x[:, :32].contiguous(), w.raw, w.qtype)
    with pytest.raises(RuntimeError, match="out must be bfloat16"):
        op(torch.empty(1, 9, dtype=torch.bfloat16), x, w.raw, w.qtype)


needs_panel = pytest.mark.skipif(
    not load() or not torch.ops.kvfleet_quant.quant_has_q4_panel_factored(),
    reason="factored bfloat16 Q4 panel not built (needs AVX512_BF16 and AVX512_VBMI)")


def _check_panel(qtype: int, n: int, k: int, rows: int, seed: int, shift: float = 0.0) -> None:
    w = _weight(qtype, n, k, seed, shift)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 100)).bfloat16()
    dense = w.dequantize().double()
    ref = x.double() @ dense.T
    bound = 2**-8 * ref.abs() + 2**-14 * (x.double().abs() @ dense.abs().T)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    torch.ops.kvfleet_quant.quant_linear_panel(out, x, w.raw, qtype, True)
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@needs_panel
@pytest.mark.parametrize("qtype", Q4, ids=formats.type_name)
@pytest.mark.parametrize(("n", "k"), [(5, 32), (37, 288), (64, 576), (33, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 13, 32, 33])
def test_factored_panel_matches_exact_dequantized_weights(qtype, n, k, rows):
    # n: part of a 16-row tile, a panel of 32 plus a remainder, whole panels; rows: one pass of
    # the 7-row micro-kernel, several, and uneven splits.
    _check_panel(qtype, n, k, rows, seed=n + k + rows)


@needs_panel
def test_factored_panel_large_block_minimum_keeps_precision():
    _check_panel(formats.Q4_1, 64, 576, 32, seed=9, shift=20.0)


@needs_panel
def test_factored_flag_leaves_float32_and_q8_0_on_the_rounded_panel():
    # The flag only changes bfloat16 Q4_0 / Q4_1: float32 x (the exactness gate) and Q8_0 run
    # the same panel kernel bit for bit.
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    for qtype, act in ((formats.Q4_1, x), (formats.Q8_0, x.bfloat16())):
        w = _weight(qtype, 40, 64, seed=qtype)
        a, b = (torch.empty(9, 40, dtype=act.dtype) for _ in range(2))
        torch.ops.kvfleet_quant.quant_linear_panel(a, act, w.raw, qtype, False)
        torch.ops.kvfleet_quant.quant_linear_panel(b, act, w.raw, qtype, True)
        assert torch.equal(a, b)


@needs_panel
def test_panel_q4_path_on_a_fused_layer_of_mixed_formats():
    # A Q4_1 segment takes the factored panel, the Q8_0 one the rounded panel (its weights
    # rounded to bfloat16): each part within its own reference's bound.
    parts = [_weight(formats.Q4_1, 37, 288, seed=1), _weight(formats.Q8_0, 30, 288, seed=2)]
    layer = QuantLinear(parts)
    x = torch.randn(17, 288, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = layer.run(x, PANEL_Q4).double()
    q4 = parts[0].dequantize().double()
    ref = x.double() @ q4.T
    bound = 2**-8 * ref.abs() + 2**-14 * (x.double().abs() @ q4.abs().T)
    assert bool(((got[:, :37] - ref).abs() <= bound).all())
    assert torch.equal(got[:, 37:], layer.run(x, PANEL).double()[:, 37:])


needs_packed = pytest.mark.skipif(
    not load() or not torch.ops.kvfleet_quant.quant_has_q4_panel_packed(),
    reason="panel-ordered Q4 kernel not built (needs AVX512_BF16 and AVX512_VBMI)")


@needs_packed
@pytest.mark.parametrize("qtype", Q4, ids=formats.type_name)
@pytest.mark.parametrize(("n", "k"), [(5, 32), (37, 288), (64, 576), (33, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 13, 32, 33])
def test_packed_panel_equals_the_factored_panel(qtype, n, k, rows):
    # n: a padded last panel, whole panels, a panel plus one row; rows: one and several passes
    # of the 7-row micro-kernel. Bit for bit, hence within _check_panel's bound as well.
    seed = n + k + rows
    w = _weight(qtype, n, k, seed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 100)).bfloat16()
    ref = torch.empty(rows, n, dtype=torch.bfloat16)
    torch.ops.kvfleet_quant.quant_linear_panel(ref, x, w.raw, qtype, True)
    packed = torch.ops.kvfleet_quant.quant_q4_panel_pack(w.raw, qtype)
    assert packed.numel() == (n + 31) // 32 * 32 * w.raw.shape[1]  # the GGUF bytes, padded
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    torch.ops.kvfleet_quant.quant_linear_q4p(out, x, packed, qtype)
    assert torch.equal(out, ref)


@needs_packed
def test_packed_panel_every_nibble_reaches_its_weight():
    # x one-hot: each output is the selected weight d * q (+ m), rounded once to bfloat16; a
    # wrong nibble or lane order would pick another weight.
    k = 64
    w = _weight(formats.Q4_1, 40, k, seed=3)
    dense = w.dequantize()
    packed = torch.ops.kvfleet_quant.quant_q4_panel_pack(w.raw, w.qtype)
    x = torch.eye(k, dtype=torch.bfloat16)
    out = torch.empty(k, 40, dtype=torch.bfloat16)
    torch.ops.kvfleet_quant.quant_linear_q4p(out, x, packed, w.qtype)
    assert torch.equal(out, dense.T.bfloat16())


@needs_packed
def test_packed_panel_refuses_bad_input_naming_it():
    w = _weight(formats.Q4_1, 40, 64, seed=1)
    ops = torch.ops.kvfleet_quant
    packed = ops.quant_q4_panel_pack(w.raw, w.qtype)
    x = torch.randn(3, 64).bfloat16()
    out = torch.empty(3, 40, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="qtype must be Q4_0 or Q4_1"):
        ops.quant_q4_panel_pack(w.raw, formats.Q8_0)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        ops.quant_linear_q4p(out, x.float(), packed, w.qtype)
    with pytest.raises(RuntimeError, match="packed must be quant_q4_panel_pack's output"):
        ops.quant_linear_q4p(out, x, w.raw, w.qtype)  # the row-ordered bytes: wrong size
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        ops.quant_linear_q4p(out, x[:, :48].contiguous(), packed, w.qtype)


@needs_packed
def test_panel_q4p_path_on_a_fused_layer_of_mixed_formats():
    # The packed Q4_1 segment writes its column slice of the output as PANEL_Q4 does; the
    # Q8_0 segment has no copy and runs PANEL_Q4's op; dropping the copies changes nothing.
    parts = [_weight(formats.Q4_1, 37, 288, seed=1), _weight(formats.Q8_0, 30, 288, seed=2)]
    layer = QuantLinear(parts)
    assert layer.pack_panels() == 64 * 288 // 32 * 20  # 37 rows padded to two panels
    assert layer.segments[1].packed is None
    x = torch.randn(17, 288, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = layer.run(x, PANEL_Q4P)
    assert torch.equal(got, layer.run(x, PANEL_Q4))
    layer.drop_panels()
    assert layer.segments[0].packed is None
    assert torch.equal(layer.run(x, PANEL_Q4P), got)


@needs_packed
def test_forward_takes_the_packed_panel_where_the_plan_starts_with_it():
    # forward's direct call (one plain segment, the plan's first path PANEL_Q4P) and run()'s
    # general case give the same bits; a float32 x never takes the packed op.
    layer = QuantLinear([_weight(formats.Q4_0, 40, 288, seed=4)])
    layer.pack_panels()
    layer.plan = ((64, PANEL_Q4P),)
    x = torch.randn(3, 288, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert torch.equal(layer(x), layer.run(x, PANEL_Q4))
    assert layer(x.float()).dtype == torch.float32
