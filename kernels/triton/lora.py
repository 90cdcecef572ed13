"""Segmented LoRA (SGMV-style) shrink and expand for one projection of the flat batch.

The batch's adapter rows come grouped into segments (engine.lora.batch): `rows` lists the
flat-batch row of every adapter token, segment after segment, `seg_starts` [S + 1] delimits
the segments in `rows` and `seg_slots` [S] gives each segment's adapter slot. Then

    shrink: h[i]          = x[rows[i]] @ a[slot(i)]^T          a: [L, K_rank, in]
    expand: out[rows[i]] += h[i] @ b[slot(i)]^T                b: [L, out, K_rank]

Grid (segment, row block, column block): each program multiplies a BLOCK_M x BLOCK_K tile of
its segment's rows by its adapter's weight tile, so one launch serves every adapter of the
step. Rows outside every segment (base-model requests) are never read or written.

Rounding follows the PyTorch reference (engine.lora.ops): float32 accumulation, `h` stored in
the activation dtype, the expand added to `out` in float32 and rounded once. dots run on float32
operands with IEEE precision (no TF32; bfloat16 tensor-core dots are a later optimisation).

Invariants: x, out, a and b have a contiguous last dimension; each flat row belongs to at
most one segment, so the expand's read-modify-write of `out` never races.

Checked on: CPU under TRITON_INTERPRET=1 (tests/kernels_triton/test_lora.py), float32 and
bfloat16. Written to compile for CUDA; not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.runtime import count_launch

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _program_tile(
    rows_ptr, seg_starts_ptr, seg_slots_ptr, n_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    # This program's segment rows (positions in `rows` and the flat rows they name), its
    # adapter slot and its output columns; has_rows is False past a shorter segment's end.
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    block_start = start + tl.program_id(1) * BLOCK_M
    offs_m = block_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    return block_start < end, offs_m, mask_m, rows, slot, offs_n, offs_n < n_size


@triton.jit
def _dot(acc, lhs, rhs_t):
    # float32 operands (also what the interpreter's bfloat16 storage needs), IEEE products.
    lhs = lhs.to(tl.float32)
    rhs_t = rhs_t.to(tl.float32)
    return acc + tl.dot(lhs, tl.trans(rhs_t), input_precision="ieee")


@triton.jit
def _segment_tile_dot(
    lhs_ptr, lhs_rows, lhs_stride, w_ptr, w_stride_row, k_size,
    offs_n, mask_m, mask_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # float32 [BLOCK_M, BLOCK_N] = lhs[lhs_rows, :k_size] @ w[offs_n, :k_size]^T, the body
    # both kernels share: shrink reads x at the gathered flat rows, expand reads h at its
    # compact rows; w_ptr already points at the segment's adapter slot.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_size
        lhs = tl.load(
            lhs_ptr + lhs_rows[:, None] * lhs_stride + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[:, None] * w_stride_row + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        acc = _dot(acc, lhs, w)
    return acc


@triton.jit
def lora_shrink_kernel(
    h_ptr, x_ptr, a_ptr, rows_ptr, seg_starts_ptr, seg_slots_ptr,
    in_features, rank_width, x_stride, h_stride, a_stride_slot, a_stride_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    has_rows, offs_m, mask_m, rows, slot, offs_n, mask_n = _program_tile(
        rows_ptr, seg_starts_ptr, seg_slots_ptr, rank_width, BLOCK_M, BLOCK_N
    )
    if not has_rows:  # a shorter segment than the grid's longest
        return
    acc = _segment_tile_dot(
        x_ptr, rows, x_stride, a_ptr + slot * a_stride_slot, a_stride_row, in_features,
        offs_n, mask_m, mask_n, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    tl.store(
        h_ptr + offs_m[:, None].to(tl.int64) * h_stride + offs_n[None, :],
        acc.to(h_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def lora_expand_kernel(
    out_ptr, h_ptr, b_ptr, rows_ptr, seg_starts_ptr, seg_slots_ptr,
    out_features, rank_width, out_stride, h_stride, b_stride_slot, b_stride_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    has_rows, offs_m, mask_m, rows, slot, offs_n, mask_n = _program_tile(
        rows_ptr, seg_starts_ptr, seg_slots_ptr, out_features, BLOCK_M, BLOCK_N
    )
    if not has_rows:  # a shorter segment than the grid's longest
        return
    acc = _segment_tile_dot(
        h_ptr, offs_m.to(tl.int64), h_stride, b_ptr + slot * b_stride_slot, b_stride_row,
        rank_width, offs_n, mask_m, mask_n, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    mask = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + rows[:, None] * out_stride + offs_n[None, :]
    current = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (current + acc).to(out_ptr.dtype.element_ty), mask=mask)


def sgmv_lora(
    out: torch.Tensor,  # [T, out_features], updated in place
    x: torch.Tensor,  # [T, in_features]
    a: torch.Tensor,  # [max_loras, rank_width, in_features]
    b: torch.Tensor,  # [max_loras, out_features, rank_width]
    rows: torch.Tensor,  # int64 [N]
    seg_starts: torch.Tensor,  # int32 [S + 1]
    seg_slots: torch.Tensor,  # int32 [S]
    max_segment_len: int,
) -> None:
    num_segments = seg_slots.shape[0]
    if num_segments == 0 or rows.shape[0] == 0:
        return
    assert x.stride(-1) == 1 and out.stride(-1) == 1, "rows must be contiguous"
    assert a.is_contiguous() and b.is_contiguous(), "LoRA stacks must be contiguous"
    rank_width, in_features = a.shape[1], a.shape[2]
    out_features = b.shape[1]
    h = x.new_empty(rows.shape[0], rank_width)
    row_blocks = triton.cdiv(max_segment_len, BLOCK_M)
    count_launch("lora_shrink")
    lora_shrink_kernel[(num_segments, row_blocks, triton.cdiv(rank_width, BLOCK_N))](
        h, x, a, rows, seg_starts, seg_slots,
        in_features, rank_width, x.stride(0), h.stride(0), a.stride(0), a.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    count_launch("lora_expand")
    lora_expand_kernel[(num_segments, row_blocks, triton.cdiv(out_features, BLOCK_N))](
        out, h, b, rows, seg_starts, seg_slots,
        out_features, rank_width, out.stride(0), h.stride(0), b.stride(0), b.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
