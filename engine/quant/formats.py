"""GGML block-quantization formats: which ones exist, their block layout, and dequantization.

A quantized [N, K] weight is kept as GGUF stores it: uint8 [N, K / block * block_bytes], one
row of blocks per output feature. `dequantize` turns such rows back into float32 with the very
operations gguf-py (hence transformers' GGUF loader) uses — `d * q` then `+ m`, each rounded to
float32, the fp16 scales widened exactly — so our dense reference equals transformers' weights
bit for bit. Q8_0, Q4_0 and Q4_1 are done in torch (fast, and the kernel's formats); any other
type gguf-py knows (the K-quants: Q4_K, Q5_K, Q6_K, ...) goes through gguf-py's numpy code.

Invariant: `row_bytes(qtype, K) == K // block_size(qtype) * type_size(qtype)` for every
supported type; a K that is not a whole number of blocks is refused.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q4_0 = int(GGMLQuantizationType.Q4_0)
Q4_1 = int(GGMLQuantizationType.Q4_1)
Q8_0 = int(GGMLQuantizationType.Q8_0)
Q5_0 = int(GGMLQuantizationType.Q5_0)
Q4_K = int(GGMLQuantizationType.Q4_K)
Q5_K = int(GGMLQuantizationType.Q5_K)
Q6_K = int(GGMLQuantizationType.Q6_K)
F32 = int(GGMLQuantizationType.F32)
F16 = int(GGMLQuantizationType.F16)
BF16 = int(GGMLQuantizationType.BF16)
# Formats the C++ kernel (kernels/cpu/quant/quant_gemm.cpp) reads directly.
KERNEL_TYPES = frozenset({Q4_0, Q4_1, Q8_0})
# Formats kernels/cpu/quant/kquant_gemm.cpp reads directly (ops kquant_linear / kquant_dequantize);
# Q5_0 is there because llama.cpp's K-quant mixes use it where K is not a multiple of 256.
KQUANT_TYPES = frozenset({Q5_0, Q4_K, Q5_K, Q6_K})
QUANTIZED_KERNEL_TYPES = KERNEL_TYPES | KQUANT_TYPES
FLOAT_TYPES = frozenset({F32, F16, BF16})


def type_name(qtype: int) -> str:
    return GGMLQuantizationType(qtype).name


def block_size(qtype: int) -> int:
    return int(GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0])


def type_size(qtype: int) -> int:
    return int(GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1])


def row_bytes(qtype: int, k: int) -> int:
    block = block_size(qtype)
    if k % block:
        raise ValueError(f"{type_name(qtype)} rows need K a multiple of {block}, got {k}")
    return k // block * type_size(qtype)


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, widened to float32, shape [..., nb, 1]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # ggml's order: low nibbles are elements 0..15 of the block, high nibbles 16..31.
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def dequantize(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 rows [N, row_bytes] of `qtype` -> float32 [N, k]."""
    n = raw.shape[0]
    if qtype in KERNEL_TYPES:
        blocks = raw.view(n, k // 32, type_size(qtype))
        if qtype == Q8_0:
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
            return (q * _halves(blocks, 0)).view(n, k)
        if qtype == Q4_0:
            q = (_nibbles(blocks[..., 2:]).to(torch.int8) - 8).float()
            return (_halves(blocks, 0) * q).view(n, k)
        q = _nibbles(blocks[..., 4:]).float()
        return (_halves(blocks, 0) * q + _halves(blocks, 2)).view(n, k)
    if qtype == F32:
        return raw.view(torch.float32).view(n, k)
    array = gguf_dequantize(raw.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).view(n, k)


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 [N, K] -> uint8 rows by gguf-py's reference quantizer (tests, int8 at load)."""
    from gguf.quants import quantize as gguf_quantize

    array = gguf_quantize(weight.float().numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(array))
