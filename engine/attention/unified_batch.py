"""The step's flat batch described for the unified Triton attention kernel.

Sequence s (the s-th scheduled request, in flat-batch order) owns query rows
[query_start_loc[s], query_start_loc[s + 1]) and has seq_lens[s] tokens of context once this
step's K/V is written (earlier context + this chunk); its KV blocks are block_tables[s]
(columns past the blocks it needs are padding, block 0, never read). A decode is a sequence
with one query row: prefills and decodes need no separate description.

Built on the host, in int32, from the same scheduler output as `engine.worker.input_batch`, so the
two describe the same flat order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.scheduler_output import ScheduledRequest


@dataclass(frozen=True, eq=False)
class UnifiedBatch:
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32, this step's tokens included
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0


def build_unified_batch(
    scheduled: Sequence[ScheduledRequest], block_ids: dict[str, list[int]], block_size: int
) -> UnifiedBatch:
    starts = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for item in scheduled:
        seq_len = item.request.num_computed_tokens + item.num_new_tokens
        starts.append(starts[-1] + item.num_new_tokens)
        seq_lens.append(seq_len)
        tables.append(block_ids[item.request.request_id][: -(-seq_len // block_size)])
    width = max((len(t) for t in tables), default=0)
    return UnifiedBatch(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
        ).reshape(len(tables), width),
    )
