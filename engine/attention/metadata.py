"""Per-step attention metadata, shared by all layers of one forward pass.

The flattened batch holds T query tokens. Every token's K/V is written to the cache at
`slot_mapping[t]` (slot = block_id * block_size + offset) before attention runs, so attention
can read any request's whole context, this step's tokens included, through the cache.
With sliding-window KV groups the step carries one such description per group (`groups`),
and each layer reads the one of its group.

Requests with several query tokens (prefill or a prefill chunk) are `PrefillSegment`s; requests
with a single query token are gathered into one `DecodeBatch` and attended together. With the
compiled kernels, the segments are also described once per step as one `PrefillBatch` (int32
vectors and block tables) and every layer attends all of them in one kernel call; the PyTorch
fallback attends the segments one by one. With the Triton backend the step also carries a
`UnifiedBatch` (engine.attention.unified_batch) and every layer attends all of it in one launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.attention.shared_prefix import SharedPrefixes
    from engine.attention.unified_batch import UnifiedBatch


@dataclass(frozen=True)
class PrefillSegment:
    """One request's run of query tokens [query_start, query_end) in the flat batch."""

    query_start: int
    query_end: int
    # Tokens already in the cache before this chunk (prefix hits or earlier chunks).
    num_context_tokens: int
    # Slots of the request's whole context (context + this chunk), in position order.
    context_slots: torch.Tensor  # [num_context_tokens + chunk_len] int64


@dataclass(frozen=True, eq=False)
class PrefillBatch:
    """Every prefill segment of the step, as the compiled prefill kernel reads them.

    Row s describes `prefills[s]`: its queries are flat rows [query_starts[s], query_starts[s]
    + query_lens[s]); its context (earlier tokens, then this chunk) is context_lens[s] tokens,
    found through block_tables[s] (padding: block 0, never read).
    """

    query_starts: torch.Tensor  # [S] int32
    query_lens: torch.Tensor  # [S] int32
    context_lens: torch.Tensor  # [S] int32, this chunk included
    block_tables: torch.Tensor  # [S, max_blocks] int32


@dataclass(frozen=True, eq=False)
class DecodeBatch:
    """Single-token queries, attended together.

    The kernel path reads K/V in place through `block_tables`; the PyTorch fallback gathers
    each request's context through `context_slots` (padded) and masks the padding.
    """

    query_indices: torch.Tensor  # [B] int64 positions in the flat batch
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padding: block 0)
    context_lens: torch.Tensor  # [B] int32, this step's token included
    block_size: int
    # (start, end) when query_indices is exactly range(start, end): attention slices instead of
    # gathering and scattering.
    query_span: tuple[int, int] | None = None
    # Requests sharing cached prefix blocks, for the compiled kernel (None: no such group).
    shared: SharedPrefixes | None = None

    @cached_property
    def context_slots(self) -> torch.Tensor:  # [B, max_len] int64 (padding points at slot 0)
        tables = self.block_tables.long()
        slots = tables.unsqueeze(2) * self.block_size + torch.arange(self.block_size)
        max_len = int(self.context_lens.max())
        return slots.flatten(1)[:, :max_len] * self.context_mask[:, 0, 0, :]

    @cached_property
    def context_mask(self) -> torch.Tensor:  # [B, 1, 1, max_len] bool, True at real tokens
        max_len = int(self.context_lens.max())
        mask = torch.arange(max_len).unsqueeze(0) < self.context_lens.unsqueeze(1)
        return mask[:, None, None, :]


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    prefills: tuple[PrefillSegment, ...]
    decode: DecodeBatch | None
    num_tokens: int
    # Whether decode attention uses the compiled CPU kernel (else the PyTorch gather path).
    use_decode_kernel: bool = False
    # Set (with the compiled kernels, when the step has prefill segments): prefill attention is
    # one kernel call per layer instead of the per-segment PyTorch loop.
    prefill_batch: PrefillBatch | None = None
    # Set with the Triton backend: the whole step for the unified kernel (the fields above
    # are then unused by attention).
    unified: UnifiedBatch | None = None
    # Sliding-window KV groups 1.. (engine.core.kv_groups): the same step described through
    # each group's block tables (slots, tables); empty when every layer shares one table.
    groups: tuple[AttentionMetadata, ...] = ()

    @cached_property
    def decode_only(self) -> bool:
        """Whether the step is decodes alone, in flat-batch order: every layer then hands the
        decode kernel its whole query and output, unsliced. Computed once, read by every layer."""
        decode = self.decode
        return decode is not None and decode.query_span == (0, self.num_tokens)
