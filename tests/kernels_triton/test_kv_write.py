"""KV write kernel vs its PyTorch reference: bit-exact (it only moves and, here, never casts).

Slots are scattered over a shuffled cache, include -1 padding (must write nothing) and land
mid-block; key/value are strided views of a fused qkv tensor, as in the engine.
"""

from __future__ import annotations

import pytest
import torch

from kernels.triton import runtime
from kernels.triton.kv_write import kv_write, kv_write_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(1, 64, 16), (3, 128, 32)])
def test_kv_write_matches_reference(dtype, num_kv_heads, head_dim, block_size, device):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens, num_heads = 12, 37, 2 * num_kv_heads
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)
    start = num_heads * head_dim
    key = qkv[:, start : start + num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, start + num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding rows
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = torch.randn(2, *shape, generator=gen).to(dtype)
    expected = caches.clone()
    kv_write_reference(key, value, expected[0], expected[1], slots)

    got = caches.to(device, copy=True)
    before = runtime.launch_counts["kv_write"]
    kv_write(key.to(device), value.to(device), got[0], got[1], slots.to(device))
    assert runtime.launch_counts["kv_write"] == before + 1
    assert not torch.equal(expected, caches), "the reference must have changed the cache"
    assert torch.equal(got.cpu(), expected)
