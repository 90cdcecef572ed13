"""Which decoding requests of a step share a cached prefix, for the CPU decode kernel.

Requests whose block tables start with the same block ids read the same K/V memory for those
positions (automatic prefix caching hands every request with an equal prefix the same cached
blocks). The decode kernel (`paged_decode_attention_shared`) then attends that prefix once for
all of them, with every query head of a KV head against each K/V row it loads, and each
request's own positions apart; the two softmax pieces are merged exactly as one softmax.

Invariants of a `SharedPrefixes`:
- group_of[r] is -1 or a group index; shared_lens[g] is a positive multiple of 16 (whole
  blocks of a block size that is a multiple of 16) and shorter than each member's context:
  the shared blocks all lie before the block holding the request's current token.
- Every member of group g has the same block ids over its first shared_lens[g] / block_size
  table entries, and a group has at least two members.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Groups sharing fewer blocks go through the plain kernel: a short shared part saves little
# and its separate pass costs a few microseconds per KV head.
MIN_SHARED_BLOCKS = 4


@dataclass(frozen=True, eq=False)
class SharedPrefixes:
    group_of: torch.Tensor  # [B] int32, -1: attends its whole context alone
    shared_lens: torch.Tensor  # [G] int32, positions


def find_shared_prefixes(
    tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int
) -> SharedPrefixes | None:
    """The groups of `tables` (one per decoding request) worth attending together, or None."""
    if block_size % 16 != 0 or len(tables) < 2:
        return None
    # Blocks wholly before the current token's block (whose K/V this step still writes).
    full = [(length - 1) // block_size for length in context_lens]
    candidates: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for r, table in enumerate(tables):
        if full[r] >= MIN_SHARED_BLOCKS:
            candidates[tuple(table[:MIN_SHARED_BLOCKS])].append(r)
    group_of = [-1] * len(tables)
    shared_lens: list[int] = []
    for members in candidates.values():
        if len(members) < 2:
            continue
        shared = _common_blocks([tables[r] for r in members], min(full[r] for r in members))
        for r in members:
            group_of[r] = len(shared_lens)
        shared_lens.append(shared * block_size)
    if not shared_lens:
        return None
    return SharedPrefixes(
        group_of=torch.tensor(group_of, dtype=torch.int32),
        shared_lens=torch.tensor(shared_lens, dtype=torch.int32),
    )


def _common_blocks(tables: list[Sequence[int]], limit: int) -> int:
    """Length of the members' common leading run of block ids, at most `limit`."""
    first = tables[0]
    shared = MIN_SHARED_BLOCKS  # the grouping key: equal by construction
    while shared < limit and all(t[shared] == first[shared] for t in tables[1:]):
        shared += 1
    return shared
