"""Unified paged attention vs its PyTorch reference, on mixed batches in one launch.

Every batch mixes decodes (one query row), prefills with no earlier context and prefill chunks
after earlier context; contexts end mid-block; block tables are random, non-contiguous
permutations whose unused tail columns point at real (random) blocks, and the whole cache is
random, so a read through the wrong block or past a sequence's end changes the result.

Tolerances (absolute, outputs are O(1) convex combinations of unit-normal values), against a
float32 reference fed the same rounded inputs:
- float32: 2e-5 — only float32 summation order differs (online softmax, base-2 exponentials).
- float16: 4e-3 — the kernel rounds softmax weights to float16 (2^-11 relative) before the
  P·V dot, as GPU flash attention does, and rounds the output.
- bfloat16: 3e-2 — the same with bfloat16's 2^-8, plus the interpreter's float32->bfloat16
  cast truncating instead of rounding to nearest (Triton 3.9), up to one more bf16 ulp.
"""

from __future__ import annotations

import pytest
import torch

from kernels.triton import runtime
from kernels.triton.unified_attention import (
    launch_shape,
    unified_attention,
    unified_attention_reference,
)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# (query tokens, context tokens incl. this step's) per sequence.
MIXED = [(1, 1), (1, 17), (5, 20), (16, 16), (1, 33), (23, 70), (3, 3), (1, 64)]
LONG = [(1, 300), (300, 300), (7, 301), (1, 2)]


def build_batch(spec, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in spec]
    width = max(blocks_per_seq) + 2  # spare columns: must never be read
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(0, num_blocks, (len(spec), width), generator=gen, dtype=torch.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = torch.tensor(perm[used : used + count], dtype=torch.int32)
        used += count
    q_lens = torch.tensor([q for q, _ in spec])
    starts = torch.zeros(len(spec) + 1, dtype=torch.int32)
    starts[1:] = q_lens.cumsum(0)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        query=torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen).to(dtype),
        key_cache=torch.randn(*shape, generator=gen).to(dtype),
        value_cache=torch.randn(*shape, generator=gen).to(dtype),
        block_tables=tables,
        query_start_loc=starts,
        seq_lens=torch.tensor([n for _, n in spec], dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def run_kernel(batch, device):
    args = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    out = torch.full_like(args["query"], float("nan"))  # every row must be written
    before = runtime.launch_counts["unified_attention"]
    unified_attention(out, **args)
    assert runtime.launch_counts["unified_attention"] == before + 1  # one launch, whole batch
    return out.cpu()


# Each GQA ratio, block size, head_dim and dtype appears; the full product is 36 cases of
# interpreter time for little extra coverage (the kernel has no code path per combination).
CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype)
    (2, 2, 64, 16, torch.float32),
    (6, 2, 64, 32, torch.float16),
    (8, 2, 128, 16, torch.bfloat16),
    (4, 1, 128, 32, torch.float32),
    (3, 1, 64, 16, torch.bfloat16),
    (2, 1, 128, 16, torch.float16),
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size", "dtype"), CASES)
def test_mixed_batch_matches_reference(
    num_heads, num_kv_heads, head_dim, block_size, dtype, device
):
    batch = build_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype)
    got = run_kernel(batch, device)
    expected = unified_attention_reference(**batch)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lengths_up_to_300(dtype, device):
    """Long ragged rows: many q-blocks per sequence and many key tiles per q-block."""
    batch = build_batch(LONG, 2, 2, 64, 16, dtype, seed=1)
    got = run_kernel(batch, device)
    torch.testing.assert_close(
        got.float(), unified_attention_reference(**batch).float(), atol=TOLERANCE[dtype], rtol=0
    )


def test_causal_mask_is_applied(device):
    """A prefill's first row sees only key 0: its output is exactly V[0] of its head."""
    batch = build_batch([(4, 4)], 1, 1, 64, 16, torch.float32)
    got = run_kernel(batch, device)
    first_block = int(batch["block_tables"][0, 0])
    torch.testing.assert_close(got[0, 0], batch["value_cache"][first_block, 0, 0])


def test_launch_shape_keeps_dot_tiles_at_least_16():
    for num_heads, num_kv_heads in [(4, 4), (12, 4), (16, 4), (32, 1)]:
        block_q, qpk_pad = launch_shape(num_heads, num_kv_heads)
        assert block_q * qpk_pad >= 16 and qpk_pad >= num_heads // num_kv_heads
    with pytest.raises(ValueError, match="multiple"):
        launch_shape(6, 4)


@pytest.mark.parametrize(("window", "softcap"), [(8, None), (None, 2.0), (20, 5.0)])
def test_sliding_window_and_softcap_match_reference(window, softcap, device):
    """Gemma's options: keys at most window - 1 positions back (contexts run past it, prefill
    chunks cross it, and whole key tiles fall before it), and tanh-capped scores."""
    batch = build_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=2)
    batch.update(window=window, softcap=softcap)
    got = run_kernel(batch, device)
    expected = unified_attention_reference(**batch)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)
    plain = unified_attention_reference(**{**batch, "window": None, "softcap": None})
    assert not torch.allclose(expected, plain, atol=1e-3)  # the options did change the result
