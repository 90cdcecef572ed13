"""The batched LoRA delta: out[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T, per segment.

In the stacked layout (engine.lora.slots), `a` is one projection's shrink stack
[max_loras, S * R, in] and `b` its expand stack [max_loras, out, S * R] (S slices of rank R,
scaling folded into B). `add_lora_delta_torch` is the reference on that layout: one shrink and
one expand matmul per segment (adapter), views where a segment is contiguous, else a gather and
an index_add. `add_lora_delta` runs the Triton kernels (kernels/triton/lora.py) when asked — on
CUDA, or interpreted on CPU in tests — and the reference otherwise; with `cpu_packed` the
stacks are in the C++ kernel's layout (engine.lora.cpu_layout, float32 on CPU) and that kernel
(kernels/cpu/lora_delta.cpp: every segment in one call) runs instead.

Invariant: rows in no segment (base-model requests) are never written.
"""

from __future__ import annotations

import torch

from engine.lora.batch import LoRABatch


def cpu_kernel_available() -> bool:
    from kernels.cpu import load as load_cpu_kernels

    return load_cpu_kernels() and hasattr(torch.ops.kvfleet_cpu, "lora_delta")


def add_lora_delta_torch(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch
) -> None:
    for seg in batch.segments:
        if seg.span is not None:
            lo, hi = seg.span
            shrunk = torch.mm(x[lo:hi], a[seg.slot].t())
            out[lo:hi].addmm_(shrunk, b[seg.slot].t())
        else:
            shrunk = torch.mm(x.index_select(0, seg.rows), a[seg.slot].t())
            out.index_add_(0, seg.rows, torch.mm(shrunk, b[seg.slot].t()))


def add_lora_delta(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: LoRABatch,
    use_triton: bool,
    slice_offsets: torch.Tensor | None = None,
    rank: int = 0,
    cpu_packed: bool = False,
) -> None:
    """`cpu_packed`: `a` and `b` are packed for the C++ kernel, which then needs
    `slice_offsets` (int64 [S + 1], the fused slices' output columns) and `rank` (R)."""
    if cpu_packed:
        if slice_offsets is None:
            raise ValueError("the packed CPU LoRA kernel needs the slices' offsets")
        torch.ops.kvfleet_cpu.lora_delta(
            out, x, a, b, batch.rows, batch.seg_starts, batch.seg_slots, slice_offsets, rank
        )
    elif use_triton:
        from kernels.triton.lora import sgmv_lora

        sgmv_lora(
            out, x, a, b, batch.rows, batch.seg_starts, batch.seg_slots, batch.max_segment_len
        )
    else:
        add_lora_delta_torch(out, x, a, b, batch)
