"""`LoRABatch`: which rows of one step's flat batch run which adapter slot.

Built once per step from the scheduled requests in flat-batch order (each contributes
`num_new_tokens` consecutive rows) and each request's slot (-1: the base model). Rows with an
adapter are grouped by slot into segments (stable order inside a segment), so the delta is
one shrink and one expand per segment however the requests interleave; rows of base-model
requests appear in no segment and get no delta. A segment whose rows are one contiguous range
of the flat batch also carries that range, so the PyTorch path can use views, not gathers.

Invariants: segments are disjoint and each is non-empty; `rows` is the concatenation of the
segments' rows (`seg_starts` delimits them) — the layout the Triton kernels read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRASegment:
    slot: int
    start: int  # into LoRABatch.rows
    end: int
    rows: torch.Tensor  # int64 flat-batch rows of this segment
    span: tuple[int, int] | None  # (first, last + 1) when the rows are contiguous


@dataclass(frozen=True)
class LoRABatch:
    num_tokens: int
    segments: tuple[LoRASegment, ...]
    rows: torch.Tensor  # int64 [N]: every adapter row, segment after segment
    seg_starts: torch.Tensor  # int32 [S + 1]
    seg_slots: torch.Tensor  # int32 [S]
    max_segment_len: int


def build_lora_batch(
    row_counts: Sequence[tuple[int, int]], device: torch.device | None = None
) -> LoRABatch | None:
    """`row_counts`: (num rows, slot or -1) per request in flat order; None if no adapter."""
    by_slot: dict[int, list[range]] = {}
    offset = 0
    for count, slot in row_counts:
        if slot >= 0 and count > 0:
            by_slot.setdefault(slot, []).append(range(offset, offset + count))
        offset += count
    if not by_slot:
        return None
    segments: list[LoRASegment] = []
    flat: list[int] = []
    for slot in sorted(by_slot):
        ranges = by_slot[slot]
        rows = [row for part in ranges for row in part]
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        span = (rows[0], rows[-1] + 1) if contiguous else None
        start = len(flat)
        flat.extend(rows)
        segments.append(
            LoRASegment(slot, start, len(flat), torch.tensor(rows, device=device), span)
        )
    starts = [s.start for s in segments] + [len(flat)]
    return LoRABatch(
        num_tokens=offset,
        segments=tuple(segments),
        rows=torch.tensor(flat, dtype=torch.int64, device=device),
        seg_starts=torch.tensor(starts, dtype=torch.int32, device=device),
        seg_slots=torch.tensor([s.slot for s in segments], dtype=torch.int32, device=device),
        max_segment_len=max(s.end - s.start for s in segments),
    )
