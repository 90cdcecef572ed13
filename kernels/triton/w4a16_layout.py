"""The Triton W4A16 GEMM's weight layout (kernels/triton/w4a16.py): packing plain int4 codes
into it, and the dequantize-then-matmul reference the kernel is tested against.

Kept apart from the kernel module so that a model can pack its weights at load without
importing a `@triton.jit` function: Triton fixes compiled-or-interpreted at that import, which
kernels/triton/runtime.load decides later, at start-up.

Layout: qweight int32 [K/8, N], input row 8r + i of column n at bits 4i..4i+3 of qweight[r, n];
scales [K/G, N] as given (fp16); zeros uint8 [K/G, N] (true zero points, 0..16).
"""

from __future__ import annotations

import torch


def pack_w4a16(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes q [K, N] (0..15), zeros z and scales s [K/G, N] -> (qweight, scales, zeros) in
    the kernel's layout."""
    k, n = q.shape
    nibbles = q.to(torch.int64).reshape(k // 8, 8, n)
    packed = torch.zeros(k // 8, n, dtype=torch.int64)
    for i in range(8):
        packed |= nibbles[:, i] << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed, s.contiguous(), z.to(torch.uint8).contiguous()


def w4a16_reference(x: torch.Tensor, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Dequantize-then-matmul in float32: x @ ((q - z) * s)."""
    zz = z.float().repeat_interleave(group_size, 0)
    ss = s.float().repeat_interleave(group_size, 0)
    return x.float() @ ((q.float() - zz) * ss)
