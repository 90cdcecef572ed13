"""The compiled paged prefill kernel equals plain PyTorch attention over each segment's gathered
context, on stressful shapes: ragged chunk lengths 1..300, contexts ending mid-block, chunks
with and without earlier context, several segments per call, scattered block tables, block
sizes other than 16, GQA groups 1 to 4, head sizes 16 to 128, a strided query, and flat rows
between segments (decodes) that the kernel must leave alone."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import load

SCALE = 0.125


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    assert load(), "the CPU kernels should build on this machine (g++ and ninja are installed)"


def reference(q, k_cache, v_cache, tables, starts, lens, ctx):
    """float32 SDPA per segment over its context gathered through the block table."""
    block_size, kv_heads, dim = k_cache.shape[1:]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for s in range(len(lens)):
        c, n, start = int(ctx[s]), int(lens[s]), int(starts[s])
        slots = (tables[s].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
        k = k_cache.reshape(-1, kv_heads, dim)[slots[:c]].float().transpose(0, 1)
        v = v_cache.reshape(-1, kv_heads, dim)[slots[:c]].float().transpose(0, 1)
        qh = q[start : start + n].float().transpose(0, 1)
        mask = torch.arange(c).unsqueeze(0) <= torch.arange(c - n, c).unsqueeze(1)
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
        out[start : start + n] = o.transpose(0, 1)
    return out


def make_case(segs, heads, kv_heads, dim, dtype, block_size, seed, gap=0):
    """segs: (chunk_len, context_len) pairs. Blocks are handed out in a shuffled order; `gap`
    flat rows follow each segment (stand-ins for decode rows). q is a strided view into a wider
    tensor, as the model's fused qkv projection produces."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-c // block_size) for _, c in segs]
    num_blocks = sum(needed) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(segs), max(needed) + 1, dtype=torch.int32)  # padded
    for row, n in enumerate(needed):
        tables[row, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    starts, offset = [], 0
    for n, _ in segs:
        starts.append(offset)
        offset += n + gap
    wide = torch.randn(offset, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    q = wide[:, :heads]
    i32 = torch.int32
    return (
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(starts, dtype=i32),
        torch.tensor([n for n, _ in segs], dtype=i32),
        torch.tensor([c for _, c in segs], dtype=i32),
    )


def run_kernel(q, k_cache, v_cache, tables, starts, lens, ctx):
    out = torch.full(q.shape, 7.0, dtype=q.dtype)  # sentinel: rows no segment owns keep it
    torch.ops.kvfleet_cpu.paged_prefill_attention(
        out, q, k_cache, v_cache, tables, starts, lens, ctx, SCALE
    )
    return out


def random_segments(rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    segs = []
    for _ in range(rng.randint(1, 6)):
        n = rng.choice([1, 2, 15, 16, 17, rng.randint(1, 300)])
        earlier = rng.choice([0, 0, block_size, 3 * block_size - 1, rng.randint(1, 200)])
        segs.append((n, n + earlier))
    return segs


def check(case, dtype, tol, gap):
    got = run_kernel(*case)
    expected = reference(*case)
    q, starts, lens = case[0], case[4], case[5]
    owned = torch.zeros(q.shape[0], dtype=torch.bool)
    for start, n in zip(starts.tolist(), lens.tolist(), strict=True):
        owned[start : start + n] = True
    torch.testing.assert_close(got[owned].float(), expected[owned], atol=tol, rtol=tol)
    if gap:
        assert torch.all(got[~owned] == 7.0), "the kernel wrote rows outside every segment"


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (4, 4, 128), (8, 2, 128), (12, 3, 64), (4, 2, 16), (6, 3, 32)],
)
def test_prefill_kernel_matches_gathered_attention(dtype, tol, heads, kv_heads, dim):
    rng = random.Random(heads * 1000 + dim)
    for trial in range(3):
        segs = random_segments(rng, 16)
        case = make_case(segs, heads, kv_heads, dim, dtype, 16, seed=trial, gap=trial % 2)
        check(case, dtype, tol, trial % 2)


@pytest.mark.parametrize("block_size", [1, 5, 8, 32])
def test_prefill_kernel_any_block_size(block_size):
    rng = random.Random(block_size)
    for trial in range(2):
        segs = random_segments(rng, block_size)
        case = make_case(segs, 9, 3, 64, torch.float32, block_size, seed=trial, gap=1)
        check(case, torch.float32, 1e-5, 1)


def test_prefill_kernel_long_segments_and_single_tokens():
    # One long chunk after a long context beside single-token segments (a step mixing a
    # prefix-hit prompt with one-token chunk tails).
    segs = [(300, 420), (1, 1), (1, 37), (64, 64), (2, 250)]
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        check(make_case(segs, 9, 3, 64, dtype, 16, seed=5, gap=2), dtype, tol, 2)


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (16, 1), (4, 4)])
def test_prefill_kernel_short_segments_across_tile_boundaries(heads, kv_heads):
    # Verify steps' 1 + k rows and small chunks take the short-segment tiling (tiles of at
    # most 16 rows, not aligned to positions); these straddle 16-aligned boundaries.
    segs = [(9, 450), (5, 301), (16, 200), (7, 7), (3, 18), (13, 13)]
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        check(make_case(segs, heads, kv_heads, 64, dtype, 16, seed=3, gap=1), dtype, tol, 1)


def test_prefill_kernel_with_no_segments_is_a_no_op():
    q, k_cache, v_cache, tables, starts, lens, ctx = make_case(
        [(4, 4)], 4, 2, 64, torch.float32, 16, seed=0
    )
    empty = torch.zeros(0, dtype=torch.int32)
    out = torch.full(q.shape, 7.0)
    torch.ops.kvfleet_cpu.paged_prefill_attention(
        out, q, k_cache, v_cache, tables[:0], empty, empty, empty, SCALE
    )
    assert torch.all(out == 7.0)
