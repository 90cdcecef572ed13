"""Per-step attention metadata, shared by all layers of one forward pass.

The flattened batch holds T query tokens. Every token's K/V is written to the cache at
`slot_mapping[t]` (slot = block_id * block_size + offset) before attention runs, so attention
can read any request's whole context, this step's tokens included, through the cache.

Requests with several query tokens (prefill or a prefill chunk) are `PrefillSegment`s and are
attended one by one; requests with a single query token are gathered into one `DecodeBatch`
and attended together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSegment:
    """One request's run of query tokens [query_start, query_end) in the flat batch."""

    query_start: int
    query_end: int
    # Tokens already in the cache before this chunk (prefix hits or earlier chunks).
    num_context_tokens: int
    # Slots of the request's whole context (context + this chunk), in position order.
    context_slots: torch.Tensor  # [num_context_tokens + chunk_len] int64


@dataclass(frozen=True)
class DecodeBatch:
    """Single-token queries, attended together over padded context slot lists."""

    query_indices: torch.Tensor  # [B] int64 positions in the flat batch
    context_slots: torch.Tensor  # [B, max_len] int64 (padding points at slot 0)
    context_mask: torch.Tensor  # [B, 1, 1, max_len] bool, True where a real token is


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    prefills: tuple[PrefillSegment, ...]
    decode: DecodeBatch | None
    num_tokens: int
