"""The K-quant GEMM (kernels/cpu/quant/kquant_gemm.cpp: Q4_K, Q5_K, Q6_K and Q5_0) against
dequantize-then-matmul, and its dequantization against gguf-py's, bit for bit.

gguf-py has no quantizer for the K-quants, so their test blocks are random bytes with the
fp16 scales overwritten by small finite values (every byte pattern of the packed 6-bit scales,
nibbles and high bits is a valid block); Q5_0 goes through gguf-py's reference quantizer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.quant import formats
from engine.quant.qlinear import QuantLinear, QuantTensor
from kernels.cpu.quant import load

K = 512
KQUANTS = [formats.Q4_K, formats.Q5_K, formats.Q6_K]
# Byte offsets of each format's fp16 scales within a block.
_HALVES = {formats.Q4_K: (0, 2), formats.Q5_K: (0, 2), formats.Q6_K: (208,)}


def _random_blocks(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    nb, size = k // formats.block_size(qtype), formats.type_size(qtype)
    blocks = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    for offset in _HALVES[qtype]:
        scale = rng.uniform(1e-4, 2e-2, size=(n, nb)).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(blocks.reshape(n, nb * size))


def _weight(qtype: int, n: int, seed: int = 0, k: int = K) -> QuantTensor:
    if qtype == formats.Q5_0:
        gen = torch.Generator().manual_seed(seed)
        return QuantTensor(formats.quantize(torch.randn(n, k, generator=gen), qtype), qtype, k)
    return QuantTensor(_random_blocks(qtype, n, k, seed), qtype, k)


def _gguf_py(t: QuantTensor) -> torch.Tensor:
    array = gguf_dequantize(t.raw.numpy(), GGMLQuantizationType(t.qtype))
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).view(t.rows, t.k)


FORMATS = [*KQUANTS, formats.Q5_0]
needs_kernel = pytest.mark.skipif(not load(), reason="quantized GEMM kernel not built")


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
def test_dequantize_equals_gguf_py(qtype):
    t = _weight(qtype, 40)
    assert torch.equal(t.dequantize(), _gguf_py(t))  # the C++ op
    assert torch.equal(formats.dequantize(t.raw, qtype, K), _gguf_py(t))


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_kernel_matches_dequantized_matmul(qtype, rows):
    parts = [_weight(qtype, 40, seed=1), _weight(qtype, 24, seed=2)]  # a fused projection
    layer = QuantLinear(parts)
    assert layer.use_kernel
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    dense = torch.cat([_gguf_py(p) for p in parts])
    ref = x.double() @ dense.double().T
    got = layer.forward(x)
    assert got.shape == (rows, 64)
    scale = ref.abs().max().item()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * scale)
    layer.kernel_max_rows = 0  # the dequantize + F.linear path
    torch.testing.assert_close(layer.forward(x).double(), ref, rtol=1e-5, atol=1e-5 * scale)


@needs_kernel
def test_mixed_formats_in_one_projection():
    # A fused q/k/v whose parts differ in format (Gemma 3 270M: q, k Q5_0 and v Q8_0).
    q8 = formats.quantize(torch.randn(16, K, generator=torch.Generator().manual_seed(5)),
                          formats.Q8_0)
    parts = [_weight(formats.Q5_0, 32, seed=3), _weight(formats.Q5_0, 8, seed=4),
             QuantTensor(q8, formats.Q8_0, K)]
    layer = QuantLinear(parts)
    assert len(layer.segments) == 2 and layer.use_kernel
    x = torch.randn(2, K)
    ref = x.double() @ torch.cat([p.dequantize() for p in parts]).double().T
    torch.testing.assert_close(layer.forward(x).double(), ref, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
def test_bad_shapes_are_refused(qtype):
    t = _weight(qtype, 4)
    with pytest.raises(RuntimeError, match="row bytes do not match K"):
        torch.ops.kvfleet_quant.kquant_linear(torch.empty(1, 4), torch.randn(1, K * 2), t.raw,
                                              qtype)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        torch.ops.kvfleet_quant.kquant_linear(torch.empty(1, 4), torch.randn(1, K), t.raw,
                                              formats.Q8_0)
