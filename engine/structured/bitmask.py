"""Packed token bitmasks -> allowed-token masks, and masking logits with them.

Role: the runner fills one packed int32 row per constrained sampled request (the matchers'
layout, engine.structured.backend); `unpack` turns them into bool [rows, vocab] masks the
sampler applies to its float32 logits before anything else reads them (logprobs included).

Invariants: plain tensor ops (no torch.compile: a first call must not compile on 2 CPU cores);
token ids at or beyond the packed width are disallowed.
"""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def allocate(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A packed bitmask for `num_rows` rows, every token allowed."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the packed row allows the token."""
    rows = bitmask.shape[0]
    bits = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().reshape(rows, -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(rows, vocab_size - bits.shape[1], dtype=torch.bool)
    return torch.cat([bits, pad], dim=1)


def mask_logits(logits: torch.Tensor, index: list[int], allowed: torch.Tensor) -> None:
    """In place: logits[index[j], t] = -inf wherever allowed[j, t] is False."""
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
