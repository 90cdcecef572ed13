"""W4A16 GEMM for int4 group-quantized weights (AWQ / GPTQ checkpoints) on CUDA:
out = x @ ((q - z) * s), the weight dequantized inside the GEMM, never materialised.

Layout (kernels/triton/w4a16_layout.py's `pack_w4a16`, from plain codes): qweight int32 [K/8, N],
input row 8r + i of column n at bits 4i..4i+3 of qweight[r, n] (GPTQ's qweight layout; an AWQ
weight is repacked into it once at load); scales [K/G, N] (fp16, as the checkpoint stores
them); zeros uint8 [K/G, N] (the true zero point, 0..16, GPTQ's z - 1 already undone). Input
row k belongs to group k // G.

Numerics: (q - z) * s is computed in float32, where it is exact (a small integer times an
fp16). For float32 activations the tile product is `tl.dot` at IEEE float32 precision (no
TF32), so the result is dequantize-then-matmul up to float32 summation order. For fp16 /
bfloat16 activations the dequantized tile is rounded to the activation dtype before `tl.dot`
(the tensor cores' inputs), accumulating in float32, as a 16-bit dense model multiplies its
rounded weights; the output is rounded once to the activation dtype.

Invariants: grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); masked tails on M, N and K; x rows
contiguous. Checked on: CPU under TRITON_INTERPRET=1 (tests/kernels_triton/test_w4a16.py),
against dequantize-then-matmul. Not yet compiled or run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.runtime import count_launch

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def w4a16_gemm_kernel(
    out_ptr, x_ptr, qweight_ptr, scales_ptr, zeros_ptr, M, N, K, group_size,
    x_stride, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        packed = tl.load(qweight_ptr + (ks // 8)[:, None] * N + cols[None, :], mask=w_mask,
                         other=0)
        # Arithmetic shift of a negative int32 fills with ones; the mask keeps the nibble.
        q = (packed >> ((ks % 8) * 4)[:, None]) & 0xF
        group = (ks // group_size)[:, None] * N + cols[None, :]
        s = tl.load(scales_ptr + group, mask=w_mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + group, mask=w_mask, other=0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(dtype))
    out = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] (float32 / float16 / bfloat16) @ the int4 weight -> [M, N] in x's dtype."""
    m, k = x.shape
    n = scales.shape[1]
    if qweight.shape != (k // 8, n) or k % 8:
        raise ValueError(f"qweight: shape {tuple(qweight.shape)}, expected ({k // 8}, {n})")
    if scales.shape != zeros.shape or scales.shape[0] * group_size != k:
        raise ValueError(f"scales / zeros: shapes {tuple(scales.shape)} / {tuple(zeros.shape)}"
                         f", expected ({k // group_size}, {n}) for group_size {group_size}")
    out = x.new_empty(m, n)
    if m == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    count_launch("w4a16_gemm")
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    w4a16_gemm_kernel[grid](
        out, x, qweight, scales, zeros, m, n, k, group_size, x.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32,
    )
    return out
