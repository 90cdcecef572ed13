"""Fused RMSNorm, optionally with the residual add in front: one pass per row.

`rms_norm(out, x, weight, eps, residual=None)`: with a residual, first residual += x (in place,
rounded to the activation dtype, as PyTorch's add is), then out = RMSNorm(residual); without,
out = RMSNorm(x). The norm follows transformers' LlamaRMSNorm op for op: upcast to float32,
x * rsqrt(mean(x^2) + eps), round to the activation dtype, multiply by the weight, round again
— so the only difference from the PyTorch reference is the order of the float32 sum.

Invariants: rows are contiguous in the hidden dimension (row strides are free); the whole row
is one tile (hidden size padded to a power of two, masked); all arithmetic is float32 (also
needed under the interpreter, which stores bfloat16 as raw 16-bit integers).

Checked on: CPU under TRITON_INTERPRET=1 (tests/kernels_triton), float32/float16/bfloat16;
compiled and run on an NVIDIA H100 (Triton 3.6, torch 2.11+cu130, `make gpu-check`,
2026-11-24): the same tests pass there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.runtime import count_launch


@triton.jit
def rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    hidden_size,
    out_stride,
    x_stride,
    residual_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + row * residual_stride + cols
        res = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        summed = (res + h).to(dtype)
        tl.store(res_ptrs, summed, mask=mask)
        h = summed.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / hidden_size
    normed = (h * tl.math.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (weight * normed).to(dtype), mask=mask)


def rms_norm(
    out: torch.Tensor,  # [T, hidden]
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden], updated in place: residual += x
) -> None:
    num_tokens, hidden_size = x.shape
    if num_tokens == 0:
        return
    for name, tensor in (("out", out), ("x", x), ("residual", residual)):
        assert tensor is None or tensor.stride(-1) == 1, f"{name} rows must be contiguous"
    count_launch("rms_norm")
    rms_norm_kernel[(num_tokens,)](
        out,
        x,
        x if residual is None else residual,  # never read without HAS_RESIDUAL
        weight,
        hidden_size,
        out.stride(0),
        x.stride(0),
        0 if residual is None else residual.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden_size),
    )


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' LlamaRMSNorm (after `residual += x` when a residual is given)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
