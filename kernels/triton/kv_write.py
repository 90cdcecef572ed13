"""KV write: this step's new K/V rows into the paged cache, through `slot_mapping`.

Cache layout (one layer): key_cache and value_cache are each [num_blocks, block_size,
num_kv_heads, head_dim] (the engine passes kv_cache[0] and kv_cache[1] of its
[2, num_blocks, ...] tensor). Flat token t goes to slot s = slot_mapping[t], i.e. block
s // block_size, offset s % block_size; a negative slot means padding and writes nothing
(vLLM's convention, so CUDA-graph padding rows can be launched safely).

Invariants: key/value may be strided views (slices of the fused qkv projection): only the
last dimension must be contiguous. Rows are cast to the cache dtype on store. One program
per token; the [heads, head_dim] tile is padded to powers of two and masked.

Checked on: CPU under TRITON_INTERPRET=1 (tests/kernels_triton); compiled and run on an
NVIDIA H100 (Triton 3.6, torch 2.11+cu130, `make gpu-check`, 2026-11-24): the same tests
pass there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.runtime import count_launch


@triton.jit
def kv_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    num_kv_heads,
    head_dim,
    block_size,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    row = token.to(tl.int64)
    k = tl.load(
        key_ptr + row * key_stride_t + heads[:, None] * key_stride_h + dims[None, :],
        mask=mask,
    )
    v = tl.load(
        value_ptr + row * value_stride_t + heads[:, None] * value_stride_h + dims[None, :],
        mask=mask,
    )
    dest = (
        block * cache_stride_block
        + offset * cache_stride_offset
        + heads[:, None] * cache_stride_head
        + dims[None, :]
    )
    tl.store(key_cache_ptr + dest, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dest, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def kv_write(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 (or int32); < 0 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    count_launch("kv_write")
    kv_write_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        head_dim,
        key_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


def kv_write_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """PyTorch reference: what engine.attention.paged_attention does, plus the padding rule."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k.index_copy_(0, slots, key[keep].to(flat_k.dtype))
    flat_v.index_copy_(0, slots, value[keep].to(flat_v.dtype))
