"""Linear and embedding layers whose weights stay GGUF block-quantized in memory.

`QuantLinear` holds one or more row segments (a fused q/k/v or gate/up projection is its
GGUF tensors stacked; segments of one format are merged into one). A forward pass takes one
of three paths by its number of rows, per the layer's `plan` (measured at start by
engine.quant.select):

- KERNEL (kernels/cpu/quant/quant_gemm.cpp; kquant_gemm.cpp for Q5_0 and the K-quants): each
  block dequantized in registers, for few rows (decode at small batch: the weight is read
  once, 4.5-8.5 bits a weight);
- PANEL (quant_panel.cpp): a panel of weight rows dequantized into a cache-resident buffer
  and reused over every row, for 8-64 rows (Q8_0/Q4_0/Q4_1; a K-quant segment takes KERNEL's
  op there, the plan measured at start decides whether that pays); PANEL_Q4, the same for a
  bfloat16 model but with its Q4_0/Q4_1 segments in the factored panel (quant_panel_q4f.h:
  exact 128 + q, the block's scale and minimum applied in float32), the plan picks one;
  PANEL_Q4P, the same product bit for bit over a panel-ordered copy of those segments made at
  load (quant_panel_q4p.h: no transpose, decoded inside the micro-kernel; the plan frees the
  copies where it does not take the path, and a layer without one, such as a Q8_0 LM head,
  follows `plan_unpacked`);
- DENSE: the whole weight dequantized (bit-equal to gguf-py) and F.linear, whose BLAS wins
  once the weight is reused over many rows (prefill), and wherever the kernels are missing.

Numerics: a float32 model computes every path in float32 (x @ dequantize(W)^T; only the
summation order differs). A bfloat16 model keeps bfloat16 activations: PANEL (on CPUs with
AVX512_BF16) and DENSE then multiply bfloat16 weights (the dequantized values rounded, as a
bfloat16 dense copy holds them) with float32 accumulation, as the dense bfloat16 model
does; KERNEL computes in float32 and rounds its output, except one row of a Q4_0/Q4_1
segment (batch-1 decode), which takes the factored kernel (quant_gemv_bf16.h: exact integer
nibbles times bfloat16 x by vdpbf16ps, then the block's scale and minimum in float32; the
weights are not rounded). `weight_bytes` is the quantized
storage, what the layer costs in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant import formats

KERNEL, PANEL, DENSE = "kernel", "panel", "dense"
# PANEL with a bfloat16 model's Q4_0/Q4_1 segments in the factored panel (quant_panel_q4f.h:
# exact 128 + q, the block affine applied in float32); every other case runs PANEL's op.
PANEL_Q4 = "panel-q4"
# PANEL_Q4 over the panel-ordered copy of the Q4_0/Q4_1 segments made at load
# (quant_panel_q4p.h: decoded by a load, a shift and one vpternlogd inside the micro-kernel,
# no transpose); a segment without that copy runs PANEL_Q4's op. Same outputs bit for bit.
PANEL_Q4P = "panel-q4p"
# (largest row count, path), in increasing row counts; more rows than the last entry: DENSE.
Plan = tuple[tuple[int, str], ...]
DEFAULT_PLAN: Plan = ((8, KERNEL), (64, PANEL))


@dataclass
class QuantTensor:
    """One GGUF tensor's rows: uint8 [N, row_bytes] of `qtype`, logical shape [N, K]."""

    raw: torch.Tensor
    qtype: int
    k: int
    # Q4_0/Q4_1 only, bfloat16 models: the same blocks re-laid in panel order
    # (quant_q4_panel_pack), beside `raw`, which the other paths read. None: not made or dropped.
    packed: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in float32 (or bfloat16: those values rounded), by the C++ op where it
        applies (fast), else formats.dequantize."""
        ops = torch.ops.kvfleet_quant
        if self.qtype in formats.KQUANT_TYPES and _kernel_ready():
            out = torch.empty(self.rows, self.k)  # the K-quant op writes float32 only
            ops.kquant_dequantize(out, self.raw, self.qtype)
            return out.to(dtype)
        if self.qtype in formats.KERNEL_TYPES and _kernel_ready() and dtype in _OP_DTYPES:
            out = torch.empty(self.rows, self.k, dtype=dtype)
            ops.quant_dequantize(out, self.raw, self.qtype)
            return out
        return formats.dequantize(self.raw, self.qtype, self.k).to(dtype)


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


_OP_DTYPES = (torch.float32, torch.bfloat16)
_ready: dict[str, bool] = {}


def _kernel_ready() -> bool:
    # Cached here: load() takes a lock, and a step calls this ~120 times.
    ready = _ready.get("ok")
    if ready is None:
        from kernels.cpu.quant import load

        ready = _ready["ok"] = load()
        _ready["bf16"] = ready and bool(torch.ops.kvfleet_quant.quant_has_bf16_dot())
    return ready


def _bf16_dot() -> bool:
    """Whether PANEL takes bfloat16 activations as they are (AVX512_BF16 compiled in)."""
    return _kernel_ready() and _ready["bf16"]


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W kept block-quantized."""

    # Which path a batch of how many rows takes; set for every layer at start
    # (engine.quant.select). (): always DENSE.
    plan: Plan = DEFAULT_PLAN
    # The plan fitted without PANEL_Q4P, for a layer with no panel-ordered copy (a Q8_0 LM
    # head beside Q4 projections): PANEL_Q4P would run it on PANEL_Q4's op at rows where the
    # measured plan without that path takes another (the register kernel at batch 1).
    plan_unpacked: Plan = DEFAULT_PLAN

    def __init__(self, parts: list[QuantTensor], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.segments = merge_segments(parts)
        self.in_features = parts[0].k
        self.out_features = sum(p.rows for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.use_kernel = all(s.qtype in formats.QUANTIZED_KERNEL_TYPES for s in self.segments)
        # Every segment's register kernel takes bfloat16 activations as they are (no float32
        # copy in, no bfloat16 rounding pass out: two tensor ops a projection at batch 1).
        self.bf16_kernel = all(s.qtype in formats.KERNEL_TYPES for s in self.segments)
        # forward's direct call applies (the kernel built, checked once here: a layer is made
        # after the model's weights load, when the op is needed anyway).
        self._direct = (self.bias is None and len(self.segments) == 1 and self.bf16_kernel
                        and _kernel_ready())

    @property
    def weight_bytes(self) -> int:
        return sum(s.raw.numel() + (0 if s.packed is None else s.packed.numel())
                   for s in self.segments)

    def pack_panels(self) -> int:
        """Make the panel-ordered copy of each Q4_0/Q4_1 segment (PANEL_Q4P) where the op is
        built; returns the bytes it adds (0: nothing made)."""
        if not _kernel_ready() or not torch.ops.kvfleet_quant.quant_has_q4_panel_packed():
            return 0
        added = 0
        for s in self.segments:
            if s.qtype in (formats.Q4_0, formats.Q4_1) and s.packed is None:
                s.packed = torch.ops.kvfleet_quant.quant_q4_panel_pack(s.raw, s.qtype)
                added += s.packed.numel()
        return added

    def drop_panels(self) -> None:
        """Free the panel-ordered copies (the plan does not use PANEL_Q4P)."""
        for s in self.segments:
            s.packed = None

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if len(self.segments) == 1:  # the usual case: no 10 MB copy through torch.cat
            return self.segments[0].dequantize(dtype)
        return torch.cat([s.dequantize(dtype) for s in self.segments])

    def active_plan(self) -> Plan:
        """`plan`, or `plan_unpacked` where `plan` takes PANEL_Q4P and no segment holds a
        panel-ordered copy."""
        if any(s.packed is not None for s in self.segments) or all(
                path != PANEL_Q4P for _, path in self.plan):
            return self.plan
        return self.plan_unpacked

    def path_for(self, rows: int) -> str:
        if not self.use_kernel or not _kernel_ready():
            return DENSE
        for limit, path in self.active_plan():
            if rows <= limit:
                return path
        return DENSE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A batch-1 decode step makes ~120 of these calls: where the plan's first path is
        # KERNEL (or PANEL_Q4P on a packed bfloat16 segment) and the layer is one plain
        # segment, the op straight away, without path_for and run()'s general case (~3 us a
        # call).
        plan, rows = self.active_plan(), x.shape[0]
        if (self._direct and plan and rows <= plan[0][0] and x.dtype in _OP_DTYPES
                and x.stride(-1) == 1):
            single = self.segments[0]
            if plan[0][1] == KERNEL:
                out = x.new_empty(rows, self.out_features)
                _op("quant_linear")(out, x, single.raw, single.qtype)
                return out
            if (plan[0][1] == PANEL_Q4P and single.packed is not None
                    and x.dtype == torch.bfloat16):
                out = x.new_empty(rows, self.out_features)
                _op("quant_linear_q4p")(out, x, single.packed, single.qtype)
                return out
        return self.run(x, self.path_for(rows))

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        """The layer by `path` (select.py times each path through this)."""
        dtype = x.dtype
        if path == DENSE or not _kernel_ready():
            wdtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
            bias = None if self.bias is None else self.bias.to(wdtype)
            out = F.linear(x.to(wdtype), self.dequantized_weight(wdtype), bias)
            return out.to(dtype)
        if path == KERNEL and self.bf16_kernel and dtype == torch.bfloat16:
            act = x  # the register kernel reads bfloat16 and rounds its output to it
        else:
            keep_bf16 = (path in (PANEL, PANEL_Q4, PANEL_Q4P) and dtype == torch.bfloat16
                         and _bf16_dot())
            act = x if keep_bf16 or dtype == torch.float32 else x.float()
        if act.stride(-1) != 1:
            act = act.contiguous()
        out = act.new_empty(act.shape[0], self.out_features)
        if len(self.segments) == 1:  # the usual case: no column slice to build
            _segment_gemm(out, act, self.segments[0], path)
        else:
            start = 0
            for s in self.segments:  # each writes its columns of `out` in place: no torch.cat
                _segment_gemm(out[:, start:start + s.rows], act, s, path)
                start += s.rows
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out if out.dtype == dtype else out.to(dtype)


# Resolved once: an attribute lookup on torch.ops costs ~1 us, and a step makes ~120 calls.
_OPS: dict[str, Callable[..., None]] = {}


def _op(name: str) -> Callable[..., None]:
    op = _OPS.get(name)
    if op is None:
        op = _OPS[name] = getattr(torch.ops.kvfleet_quant, name)
    return op


def _segment_gemm(out: torch.Tensor, act: torch.Tensor, segment: QuantTensor, path: str) -> None:
    """out = act @ dequantize(segment)^T by the op of `path` and the segment's format."""
    if segment.qtype in formats.KQUANT_TYPES:
        # The K-quant op computes in float32 into a contiguous output only.
        act = act.float()
        if out.dtype == torch.float32 and out.is_contiguous():
            _op("kquant_linear")(out, act, segment.raw, segment.qtype)
        else:
            tmp = act.new_empty(act.shape[0], segment.rows)
            _op("kquant_linear")(tmp, act, segment.raw, segment.qtype)
            out.copy_(tmp)
        return
    if path == PANEL_Q4P and segment.packed is not None and act.dtype == torch.bfloat16:
        _op("quant_linear_q4p")(out, act, segment.packed, segment.qtype)
        return
    if path in (PANEL_Q4, PANEL_Q4P):
        _op("quant_linear_panel")(out, act, segment.raw, segment.qtype, True)
        return
    _op("quant_linear_panel" if path == PANEL else "quant_linear")(
        out, act, segment.raw, segment.qtype)


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
        # QuantTensor.dequantize: the C++ op where it applies (bit-equal to gguf-py, written
        # in the model's dtype: one op instead of formats.dequantize's ~8, 0.1 ms of a
        # batch-1 step), else formats.dequantize.
        out = QuantTensor(rows, self.table.qtype, self.table.k).dequantize(self.dtype)
        return out.view(*ids.shape, self.table.k)
