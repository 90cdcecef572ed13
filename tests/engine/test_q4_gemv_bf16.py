"""The factored batch-1 bfloat16 kernel for Q4_0 / Q4_1 (kernels/cpu/quant/quant_gemv_bf16.h,
the op `quant_gemv_bf16`, also what `quant_linear` runs for one bfloat16 row of a Q4 format)
against x @ W^T with W the exact float32 dequantization (never rounded to bfloat16).

Tolerance, stated: |got - ref| <= 2^-8 |ref| + 2^-14 (|x| @ |W|^T). The first term is the
output's one bfloat16 rounding (half an ulp is 2^-9 relative); the second bounds float32
accumulation, including the 128 + q offset's cancellation (~4 bits of 24), with margin.
"""

from __future__ import annotations

import pytest
import torch

from engine.quant import formats
from engine.quant.qlinear import QuantTensor
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
