"""A step's attention metadata re-pointed at the sliding-window KV groups' block tables.

Role: sliding-window KV groups (engine.core.kv_groups) see the same step as the full-attention
group (same requests, query rows, positions and context lengths) through different block ids.
`for_groups` derives every group's `AttentionMetadata` from the step's by swapping the block
ids alone, instead of rebuilding the whole step in Python once per group. All groups go
through one [groups, requests, blocks] tensor: one conversion from Python lists per step and
one tensor op per metadata field, whatever the number of groups (Gemma 3 1B has six), since
at short contexts this is pure per-step overhead.

Invariants: every group's table of a request covers the same positions as the full group's
(engine.core.sliding_blocks), so the derived tables have the step's widths; entries the window
has released are the null block 0, which only masked (windowed) keys ever address. The derived
decode batch has no shared-prefix groups: the null entries would look like a shared prefix,
and windowed layers never take that kernel anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from engine.attention.metadata import AttentionMetadata, PrefillSegment
from engine.core.scheduler_output import ScheduledRequest


def for_groups(
    meta: AttentionMetadata,
    scheduled: Sequence[ScheduledRequest],
    group_block_ids: Mapping[str, Sequence[list[int]]],  # per request: group 1's table first
    positions: torch.Tensor,  # [T] int64, the step's positions (host)
    block_size: int,
) -> tuple[AttentionMetadata, ...]:
    """Per sliding group, the step's metadata through that group's block tables."""
    per_request = [group_block_ids[item.request.request_id] for item in scheduled]
    num_groups, num_rows = len(per_request[0]), len(per_request)
    width = max(len(row) for tables in per_request for row in tables)
    table = torch.tensor(
        [tables[g] + [0] * (width - len(tables[g]))
         for g in range(num_groups) for tables in per_request],
        dtype=torch.int64).view(num_groups, num_rows, width)
    # A list, not torch.repeat_interleave: that took ~40 ms a call on a busy 2-core machine.
    row_of_token = torch.tensor(
        [i for i, item in enumerate(scheduled) for _ in range(item.num_new_tokens)],
        dtype=torch.int64)
    slots = (table[:, row_of_token, positions // block_size] * block_size
             + positions % block_size)  # [G, T]
    decode_rows = [i for i, item in enumerate(scheduled) if item.num_new_tokens == 1]
    prefill_rows = [i for i, item in enumerate(scheduled) if item.num_new_tokens != 1]
    decode = meta.decode
    decode_tables = (None if decode is None
                     else _narrow(_rows(table, decode_rows), decode.block_tables.shape[1]))
    batch = meta.prefill_batch
    batch_tables = (None if batch is None
                    else _narrow(_rows(table, prefill_rows), batch.block_tables.shape[1]))
    unified = meta.unified
    unified_tables = (None if unified is None
                      else _narrow(table, unified.block_tables.shape[1]))
    segment_slots = [_context_slots(seg, table[:, row], block_size)
                     for seg, row in zip(meta.prefills, prefill_rows, strict=True)]
    return tuple(
        replace(
            meta, slot_mapping=slots[g],
            prefills=tuple(replace(seg, context_slots=seg_slots[g])
                           for seg, seg_slots in zip(meta.prefills, segment_slots, strict=True)),
            decode=(None if decode is None or decode_tables is None
                    else replace(decode, shared=None, block_tables=decode_tables[g])),
            prefill_batch=(None if batch is None or batch_tables is None
                           else replace(batch, block_tables=batch_tables[g])),
            unified=(None if unified is None or unified_tables is None
                     else replace(unified, block_tables=unified_tables[g])),
            groups=(),
        )
        for g in range(num_groups)
    )


def _rows(table: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """table[:, rows], without the gather when the rows are all of them in order."""
    return table if rows == list(range(table.shape[1])) else table[:, rows]


def _narrow(table: torch.Tensor, width: int) -> torch.Tensor:
    """Exactly `width` columns as int32 (padded with block 0, never read)."""
    if table.shape[-1] < width:
        table = torch.nn.functional.pad(table, (0, width - table.shape[-1]))
    return table[..., :width].to(torch.int32).contiguous()


def _context_slots(seg: PrefillSegment, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """[G, context] slots of a segment's whole context, from its [G, blocks] tables."""
    num_tokens = seg.context_slots.shape[0]
    slots = (rows.unsqueeze(2) * block_size + torch.arange(block_size)).flatten(1)
    return slots[:, :num_tokens]
