"""The W4A16 GEMM (kernels/triton/w4a16.py) against dequantize-then-matmul in float32.

Weights: AWQ / GPTQ checkpoints' codes, zeros and fp16 scales from tests/fixtures'
spec-written quantizer, in groups of 32, 64 and 128, and one group over all of K = 136 (a
checkpoint's group_size -1: a masked K tile); row counts 1, 5, 16 and 37 (masked M tails,
several M programs), N = 72 (a masked N tail), K = 160 (five K tiles).

Tolerances (|got - want| <= atol + rtol * |want|): float32, 1e-5 both — IEEE float32 dot, so
only the summation order differs; float16, rtol 2^-8 and atol 2^-10 x the row's scale — the
dequantized weight is rounded to fp16 before the product (a relative 2^-11 per weight), the
output rounded once.
"""

from __future__ import annotations

import pytest
import torch

from kernels.triton import runtime
from kernels.triton.w4a16_layout import pack_w4a16, w4a16_reference
from tests.fixtures.int4_checkpoints import quantize


def _case(k: int, n: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.05
    qz = quantize(weight, group, sym=seed % 2 == 0)
    return qz, pack_w4a16(qz.q, qz.z, qz.s)


@pytest.mark.parametrize(("k", "group"), [(128, 32), (128, 64), (160, 32), (128, 128), (136, 136)])
@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_w4a16_float32_equals_dequantize_then_matmul(device, k, group, rows):
    from kernels.triton.w4a16 import w4a16_linear

    qz, (qweight, scales, zeros) = _case(k, 72, group, seed=k + group + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = w4a16_reference(x, qz.q, qz.z, qz.s, group)
    before = runtime.launch_counts["w4a16_gemm"]
    got = w4a16_linear(x.to(device), qweight.to(device), scales.to(device), zeros.to(device),
                       group)
    assert runtime.launch_counts["w4a16_gemm"] == before + 1
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_w4a16_float16_within_one_weight_rounding(device):
    from kernels.triton.w4a16 import w4a16_linear

    qz, (qweight, scales, zeros) = _case(128, 72, 64, seed=3)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0)).half()
    want = w4a16_reference(x.float(), qz.q, qz.z, qz.s, 64)
    got = w4a16_linear(x.to(device), qweight.to(device), scales.to(device), zeros.to(device),
                       64)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float().cpu(), want, rtol=2**-8,
                               atol=2**-10 * float(want.abs().max()))


def test_w4a16_refuses_mismatched_shapes_naming_them(device):
    from kernels.triton.w4a16 import w4a16_linear

    _, (qweight, scales, zeros) = _case(128, 72, 32, seed=1)
    x = torch.randn(2, 128).to(device)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_linear(x, qweight[:-1].to(device), scales.to(device), zeros.to(device), 32)
    with pytest.raises(ValueError, match="scales / zeros"):
        w4a16_linear(x, qweight.to(device), scales.to(device), zeros.to(device), 64)
