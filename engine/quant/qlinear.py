"""Linear and embedding layers whose weights stay GGUF block-quantized in memory.

`QuantLinear` holds one or more row segments (a fused q/k/v or gate/up projection is its
GGUF tensors stacked; segments of one format are merged into one). Its forward pass either
runs the C++ kernel (kernels/cpu/quant/quant_gemm.cpp; kquant_gemm.cpp for Q5_0 and the
K-quants), which dequantizes each block inside
the GEMM, or — for batches of more than `kernel_max_rows` rows (prefill), or where the kernel
is missing — dequantizes the weight (formats.dequantize, bit-equal to gguf-py) and calls
F.linear, whose BLAS GEMM is faster once the weight is reused over many rows. The crossover
is measured at start (engine.quant.select). Activations are float32 inside; a bfloat16 model
converts at the layer's edges.

Invariant: both paths compute x @ dequantize(W)^T in float32; only the summation order
differs. `weight_bytes` is the quantized storage, what the layer costs in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant import formats


@dataclass
class QuantTensor:
    """One GGUF tensor's rows: uint8 [N, row_bytes] of `qtype`, logical shape [N, K]."""

    raw: torch.Tensor
    qtype: int
    k: int

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], by the C++ op where it applies (fast), else formats.dequantize."""
        if self.qtype in formats.QUANTIZED_KERNEL_TYPES and _kernel_ready():
            out = torch.empty(self.rows, self.k)
            ops = torch.ops.kvfleet_quant
            kquant = self.qtype in formats.KQUANT_TYPES
            op = ops.kquant_dequantize if kquant else ops.quant_dequantize
            op(out, self.raw, self.qtype)
            return out
        return formats.dequantize(self.raw, self.qtype, self.k)


def merge_segments(parts: list[QuantTensor]) -> list[QuantTensor]:
    """Stack consecutive parts of one format into one (one kernel call for fused q/k/v)."""
    merged: list[QuantTensor] = []
    for part in parts:
        if merged and merged[-1].qtype == part.qtype and merged[-1].k == part.k:
            last = merged[-1]
            merged[-1] = QuantTensor(torch.cat([last.raw, part.raw]), part.qtype, part.k)
        else:
            merged.append(part)
    return merged


_ready: dict[str, bool] = {}


def _kernel_ready() -> bool:
    # Cached here: load() takes a lock, and a step calls this ~120 times.
    ready = _ready.get("ok")
    if ready is None:
        from kernels.cpu.quant import load

        ready = _ready["ok"] = load()
    return ready


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W kept block-quantized."""

    # Batches up to this many rows run the kernel; larger ones dequantize and call F.linear.
    # 0: never the kernel. Set for every layer at start (engine.quant.select).
    kernel_max_rows: int = 64

    def __init__(self, parts: list[QuantTensor], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.segments = merge_segments(parts)
        self.in_features = parts[0].k
        self.out_features = sum(p.rows for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.use_kernel = all(s.qtype in formats.QUANTIZED_KERNEL_TYPES for s in self.segments)

    @property
    def weight_bytes(self) -> int:
        return sum(s.raw.numel() for s in self.segments)

    def dequantized_weight(self) -> torch.Tensor:
        if len(self.segments) == 1:  # the usual case: no 10 MB copy through torch.cat
            return self.segments[0].dequantize()
        return torch.cat([s.dequantize() for s in self.segments])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x if dtype == torch.float32 else x.float()
        if self.use_kernel and 0 < x.shape[0] <= self.kernel_max_rows and _kernel_ready():
            outs = [self._kernel(xf, s) for s in self.segments]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            if self.bias is not None:
                out = out + self.bias.float()
        else:
            bias = None if self.bias is None else self.bias.float()
            out = F.linear(xf, self.dequantized_weight(), bias)
        return out if dtype == torch.float32 else out.to(dtype)

    @staticmethod
    def _kernel(x: torch.Tensor, segment: QuantTensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = x.new_empty(x.shape[0], segment.rows)
        ops = torch.ops.kvfleet_quant
        op = ops.kquant_linear if segment.qtype in formats.KQUANT_TYPES else ops.quant_linear
        op(out, x, segment.raw, segment.qtype)
        return out


class QuantEmbedding(nn.Module):
    """Token embedding over quantized rows: only the looked-up rows are dequantized."""

    def __init__(self, table: QuantTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    @property
    def weight_bytes(self) -> int:
        return self.table.raw.numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.raw.index_select(0, ids.reshape(-1))
        out = formats.dequantize(rows, self.table.qtype, self.table.k)
        return out.view(*ids.shape, self.table.k).to(self.dtype)
