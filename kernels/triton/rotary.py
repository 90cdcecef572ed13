"""Rotary position embedding (rotate-half, the Llama layout), applied to q and k in place.

`rotary_embedding(query, key, positions, cos_table, sin_table)`: query [T, H, D] and key
[T, KVH, D] (strided views of the fused qkv projection are fine) are rotated at their
token's position: first half x1*c - x2*s, second half x2*c + x1*s, with c, s =
cos_table[pos], sin_table[pos] ([max_positions, D / 2] float32, the half-width tables of
`engine.models.rope.RotaryEmbedding`). Scaling schemes such as llama3's live entirely in those
tables (its inverse frequencies), so one kernel serves them all.

Rounding: c and s are rounded to the activation dtype first (transformers casts cos/sin to
x.dtype), the rotation is computed in float32 and rounded once; transformers rounds each
product too, so 16-bit results may differ from it by one unit in the last place.

Invariants: head_dim even and contiguous; one program per token, heads x half-dim tile padded
to powers of two and masked; q and k are read completely before being written.

Checked on: CPU under TRITON_INTERPRET=1 (tests/kernels_triton), float32/float16/bfloat16,
plain and llama3-scaled tables; compiled and run on an NVIDIA H100 (Triton 3.6, torch
2.11+cu130, `make gpu-check`, 2026-11-24): the same tests pass there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.runtime import count_launch


@triton.jit
def _rotate_heads(x_ptr, row, stride_t, stride_h, num_heads, half, c, s, HEADS_PAD, HALF_PAD):
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half)
    first = x_ptr + row * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(first, (x1 * c[None, :] - x2 * s[None, :]).to(dtype), mask=mask)
    tl.store(first + half, (x2 * c[None, :] + x1 * s[None, :]).to(dtype), mask=mask)


@triton.jit
def rotary_kernel(
    query_ptr,
    key_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    query_stride_t,
    query_stride_h,
    key_stride_t,
    key_stride_h,
    num_heads,
    num_kv_heads,
    half,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_ok = dims < half
    dtype = query_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * half + dims, mask=dim_ok, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * half + dims, mask=dim_ok, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(
        query_ptr, row, query_stride_t, query_stride_h, num_heads, half, c, s,
        HEADS_PAD, HALF_PAD,
    )
    _rotate_heads(
        key_ptr, row, key_stride_t, key_stride_h, num_kv_heads, half, c, s,
        KV_HEADS_PAD, HALF_PAD,
    )


def rotary_embedding(
    query: torch.Tensor,  # [T, H, D], rotated in place
    key: torch.Tensor,  # [T, KVH, D], rotated in place
    positions: torch.Tensor,  # [T] int64
    cos_table: torch.Tensor,  # [max_positions, D / 2] float32, contiguous
    sin_table: torch.Tensor,
) -> None:
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    assert head_dim % 2 == 0 and query.stride(-1) == 1 and key.stride(-1) == 1
    assert cos_table.is_contiguous() and sin_table.is_contiguous()
    assert cos_table.shape[1] == head_dim // 2
    count_launch("rotary")
    rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos_table,
        sin_table,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        num_heads,
        key.shape[1],
        head_dim // 2,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(key.shape[1]),
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
    )


def rotary_reference(
    x: torch.Tensor,  # [T, heads, D]
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> torch.Tensor:
    """transformers' form: x * cos + rotate_half(x) * sin with full-width cat((f, f)) tables."""
    cos = torch.cat((cos_table, cos_table), dim=-1)[positions].to(x.dtype).unsqueeze(1)
    sin = torch.cat((sin_table, sin_table), dim=-1)[positions].to(x.dtype).unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
