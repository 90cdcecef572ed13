"""The compiled prefill and decode kernels with a sliding window and a logit soft-cap equal
plain float32 attention with transformers' masks: keys j visible from position p when
j <= p and p - j < window, scores capped to cap * tanh(s / cap). Chunks with earlier context
cross the window, contexts run several windows long (whole key chunks skipped), head sizes
16, 64 and 256 (Gemma's), GQA, float32 and bfloat16; window 0 and cap 0 are the plain
kernels."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import load
from tests.engine.test_cpu_prefill_kernel import SCALE, make_case

SEGMENTS = [(1, 1), (5, 40), (17, 17), (30, 70), (3, 130)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    assert load(), "the CPU kernels should build on this machine (g++ and ninja are installed)"


def reference(q, k_cache, v_cache, tables, starts, lens, ctx, window, cap):
    block_size, kv_heads, dim = k_cache.shape[1:]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    for s in range(len(lens)):
        c, n, start = int(ctx[s]), int(lens[s]), int(starts[s])
        slots = (tables[s].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
        k = k_cache.reshape(-1, kv_heads, dim)[slots[:c]].float().repeat_interleave(group, 1)
        v = v_cache.reshape(-1, kv_heads, dim)[slots[:c]].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), k) * SCALE
        if cap:
            scores = torch.tanh(scores / cap) * cap
        key, pos = torch.arange(c), torch.arange(c - n, c).unsqueeze(1)
        visible = (key <= pos) & ((key > pos - window) if window else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "heads", "kv_heads"), [(16, 4, 2), (64, 2, 1), (256, 2, 1)])
@pytest.mark.parametrize(("window", "cap"), [(0, 0.0), (16, 0.0), (0, 5.0), (24, 3.0)])
def test_prefill_kernel(dtype, dim, heads, kv_heads, window, cap):
    case = make_case(SEGMENTS, heads, kv_heads, dim, dtype, 16, seed=3)
    q, k_cache, v_cache, tables, starts, lens, ctx = case
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    torch.ops.kvfleet_cpu.paged_prefill_attention(
        out, q, k_cache, v_cache, tables, starts, lens, ctx, SCALE, window, cap)
    expected = reference(*case, window, cap)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize(("window", "cap"), [(0, 0.0), (16, 0.0), (0, 5.0), (24, 3.0)])
def test_decode_kernel(dtype, dim, window, cap):
    # One query row per request: the context's last position.
    case = make_case([(1, c) for c in (1, 15, 16, 17, 40, 130)], 4, 2, dim, dtype, 16, seed=4)
    q, k_cache, v_cache, tables, starts, lens, ctx = case
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    torch.ops.kvfleet_cpu.paged_decode_attention(
        out, q, k_cache, v_cache, tables, ctx, SCALE, window, cap)
    expected = reference(*case, window, cap)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)
