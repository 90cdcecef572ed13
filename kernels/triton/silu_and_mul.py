"""SiLU-and-mul of the fused gate/up projection: out = silu(gate) * up.

`gate_up` is [T, 2 * I] with gate in the first I columns and up in the last I (the layout of
the model's fused gate_up_proj). Rounding follows PyTorch's `F.silu(gate) * up` in the
activation dtype: silu computed in float32 and rounded, then the product rounded.

Invariants: rows contiguous in the feature dimension; grid (T, cdiv(I, BLOCK)), masked tail;
float32 arithmetic throughout (also required by the interpreter's bfloat16 storage).

Checked on: CPU under TRITON_INTERPRET=1 (tests/kernels_triton), float32/float16/bfloat16;
compiled and run on an NVIDIA H100 (Triton 3.6, torch 2.11+cu130, `make gpu-check`,
2026-11-24): the same tests pass there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.triton.runtime import count_launch

BLOCK = 1024


@triton.jit
def silu_and_mul_kernel(
    out_ptr, gate_up_ptr, intermediate_size, out_stride, in_stride, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    dtype = out_ptr.dtype.element_ty
    base = gate_up_ptr + row * in_stride
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    num_tokens, width = gate_up.shape
    intermediate_size = width // 2
    if num_tokens == 0:
        return
    assert gate_up.stride(-1) == 1 and out.stride(-1) == 1, "rows must be contiguous"
    block = min(BLOCK, triton.next_power_of_2(intermediate_size))
    count_launch("silu_and_mul")
    silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate_size, block))](
        out, gate_up, intermediate_size, out.stride(0), gate_up.stride(0), BLOCK=block
    )


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
