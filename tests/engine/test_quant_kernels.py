"""The quantized GEMM (kernels/cpu/quant/quant_gemm.cpp) against a dequantize-then-matmul
reference, per GGUF format, on tiny random weights quantized by gguf-py's reference quantizer;
the dequantization against gguf-py's own; the Q/K row un-permutation against transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.quant import formats
from engine.quant.gguf_model import _unpermute
from engine.quant.qlinear import QuantLinear, QuantTensor
from kernels.cpu.quant import load

FORMATS = [formats.Q8_0, formats.Q4_0, formats.Q4_1]
K = 256


def _weight(qtype: int, n: int, seed: int = 0) -> QuantTensor:
    gen = torch.Generator().manual_seed(seed)
    return QuantTensor(formats.quantize(torch.randn(n, K, generator=gen), qtype), qtype, K)


@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
def test_dequantize_equals_gguf_py(qtype):
    t = _weight(qtype, 40)
    ref = torch.from_numpy(gguf_dequantize(t.raw.numpy(), GGMLQuantizationType(qtype)))
    assert torch.equal(formats.dequantize(t.raw, qtype, K), ref)
    assert torch.equal(t.dequantize(), ref)  # the C++ op where it loads


@pytest.mark.skipif(not load(), reason="quantized GEMM kernel not built")
@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
@pytest.mark.parametrize("rows", [1, 5, 8, 19])
def test_kernel_matches_dequantized_matmul(qtype, rows):
    parts = [_weight(qtype, 48, seed=1), _weight(qtype, 24, seed=2)]  # a fused projection
    layer = QuantLinear(parts)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    dense = torch.cat([p.dequantize() for p in parts])
    ref = x.double() @ dense.double().T
    got = layer.forward(x)
    assert got.shape == (rows, 72)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    layer.kernel_max_rows = 0  # the dequantize + F.linear path
    torch.testing.assert_close(layer.forward(x).double(), ref, rtol=1e-5, atol=1e-4)
    bf16 = layer.forward(x.bfloat16())
    assert bf16.dtype == torch.bfloat16


def test_unpermute_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, head_dim = 3, 8
    w = np.arange(heads * head_dim * 32, dtype=np.float32).reshape(heads * head_dim, 32)
    ref = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
    got = _unpermute(QuantTensor(torch.from_numpy(w).view(torch.uint8), formats.F32, 32), heads)
    assert torch.equal(got.dequantize(), torch.from_numpy(ref))
