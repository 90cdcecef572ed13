"""The batched LoRA delta: out[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T, per segment.

`a` is one projection's shrink stack [max_loras, S * R, in] and `b` its expand stack
[max_loras, out, S * R] (S slices of rank R, scaling folded into B; see engine.lora.slots).
`add_lora_delta_torch` is the reference and the CPU path: one shrink and one expand matmul per
segment (adapter), views where a segment is contiguous, else a gather and an index_add.
`add_lora_delta` picks the Triton kernels (kernels/triton/lora.py) when asked — on CUDA, or
interpreted on CPU in tests — else the reference.

Invariant: rows in no segment (base-model requests) are never written.
"""

from __future__ import annotations

import torch

from engine.lora.batch import LoRABatch


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
) -> None:
    if use_triton:
        from kernels.triton.lora import sgmv_lora

        sgmv_lora(
            out, x, a, b, batch.rows, batch.seg_starts, batch.seg_slots, batch.max_segment_len
        )
    else:
        add_lora_delta_torch(out, x, a, b, batch)
