"""A step's attention metadata re-pointed at another KV group's block tables.

Role: sliding-window KV groups (engine.core.kv_groups) see the same step as the full-attention
group (same requests, query rows, positions and context lengths) through different block ids.
`for_group_tables` derives a group's `AttentionMetadata` from the step's by swapping the block
ids alone: one padded table tensor per group and a few tensor ops, instead of rebuilding the
whole step in Python once per group.

Invariants: every group's table of a request covers the same positions as the full group's
(engine.core.sliding_blocks), so the derived tables have the step's widths; entries the window
has released are the null block 0, which only masked (windowed) keys ever address. The derived
decode batch has no shared-prefix groups: the null entries would look like a shared prefix,
and windowed layers never take that kernel anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.attention.metadata import AttentionMetadata, PrefillSegment
from engine.core.scheduler_output import ScheduledRequest


def for_group_tables(
    meta: AttentionMetadata,
    scheduled: Sequence[ScheduledRequest],
    tables: dict[str, list[int]],
    positions: torch.Tensor,  # [T] int64, the step's positions (host)
    block_size: int,
) -> AttentionMetadata:
    rows = [tables[item.request.request_id] for item in scheduled]
    width = max(len(row) for row in rows)
    table = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64)
    # A list, not torch.repeat_interleave: that took ~40 ms a call on a busy 2-core machine.
    row_of_token = torch.tensor(
        [i for i, item in enumerate(scheduled) for _ in range(item.num_new_tokens)],
        dtype=torch.int64)
    slots = table[row_of_token, positions // block_size] * block_size + positions % block_size
    decode_rows = [i for i, item in enumerate(scheduled) if item.num_new_tokens == 1]
    prefill_rows = [i for i, item in enumerate(scheduled) if item.num_new_tokens != 1]
    decode = meta.decode
    if decode is not None:
        decode = replace(decode, shared=None, block_tables=_narrow(
            table[decode_rows], decode.block_tables.shape[1]))
    batch = meta.prefill_batch
    if batch is not None:
        batch = replace(batch, block_tables=_narrow(
            table[prefill_rows], batch.block_tables.shape[1]))
    unified = meta.unified
    if unified is not None:
        unified = replace(unified, block_tables=_narrow(table, unified.block_tables.shape[1]))
    return replace(
        meta, slot_mapping=slots,
        prefills=tuple(_segment(seg, table[row], block_size)
                       for seg, row in zip(meta.prefills, prefill_rows, strict=True)),
        decode=decode, prefill_batch=batch, unified=unified, groups=(),
    )


def _narrow(table: torch.Tensor, width: int) -> torch.Tensor:
    """Exactly `width` columns as int32 (padded with block 0, never read)."""
    if table.shape[1] < width:
        table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
    return table[:, :width].to(torch.int32).contiguous()


def _segment(seg: PrefillSegment, row: torch.Tensor, block_size: int) -> PrefillSegment:
    num_tokens = seg.context_slots.shape[0]
    slots = (row.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
    return replace(seg, context_slots=slots[:num_tokens])
