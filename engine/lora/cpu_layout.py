"""The C++ CPU kernel's layout of the LoRA stacks (kernels/cpu/lora_delta.cpp), float32.

From the stacked layout of engine.lora.slots (`a` [L, S*R, in], `b` [L, out, S*R], slice s
owning its output rows and rank block s of B, zeros elsewhere):
- `pack_a`: A transposed, [L, in, W] with W = S*R rounded up to 16 (zero columns), so the
  shrink streams one contiguous row of W ranks per input feature;
- `pack_b`: each output column's own rank block only, tiled [L, ceil(out/16), R, 16]
  (zero columns past `out`), so the expand streams 16 columns x R ranks as one contiguous
  kilobyte (R = 16) and never reads B's zero blocks.
Why: in a decode step the delta is memory-bound (8 rank-16 adapters on SmolLM2 read ~156 MB);
with the stacked layout the kernel read B's rank blocks 64 bytes out of every S*R*4 and A
as four interleaved streams, at about a third of the copy bandwidth.

Invariant: packing is exact (a copy of every value the kernel reads, zeros elsewhere).
"""

from __future__ import annotations

import torch

LANES = 16


def padded_width(width: int) -> int:
    return -(-width // LANES) * LANES


def column_rank_index(slice_offsets: torch.Tensor, out_features: int, rank: int) -> torch.Tensor:
    """[out, R] int64: the columns of stacked B that output column n reads (its slice's block)."""
    col_slice = torch.bucketize(torch.arange(out_features), slice_offsets[1:], right=True)
    return (col_slice * rank)[:, None] + torch.arange(rank)[None, :]


def pack_a(a: torch.Tensor) -> torch.Tensor:
    loras, width, in_features = a.shape
    out = a.new_zeros(loras, in_features, padded_width(width))
    out[:, :, :width] = a.transpose(1, 2)
    return out


def pack_b(b: torch.Tensor, slice_offsets: torch.Tensor, rank: int) -> torch.Tensor:
    loras, out_features, _ = b.shape
    index = column_rank_index(slice_offsets, out_features, rank).to(b.device)
    compact = torch.gather(b, 2, index.expand(loras, out_features, rank))  # [L, out, R]
    blocks = -(-out_features // LANES)
    padded = b.new_zeros(loras, blocks * LANES, rank)
    padded[:, :out_features] = compact
    return padded.view(loras, blocks, LANES, rank).transpose(2, 3).contiguous()


def packed_shapes(
    in_features: int, out_features: int, num_slices: int, rank: int, loras: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the packed A and B stacks for `loras` slots."""
    return (
        (loras, in_features, padded_width(num_slices * rank)),
        (loras, -(-out_features // LANES), rank, LANES),
    )
