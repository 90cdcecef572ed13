"""The offline benchmark's workload and its bookkeeping, shared by every system it measures.

Prompts are random non-special token ids, so no system gets a prefix-cache hit it would not
get on real traffic, and every system receives the identical token ids (no tokenizer in the
loop). Invariant: one seed gives the same prompts in every run and for every system.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

# Ids this close to either end of the vocabulary are left out: the low ones are SmolLM2's
# special tokens, the high ones rarely-trained merges (vLLM's own random dataset does the same).
ID_MARGIN = 100
PROMPT_LEN_RANGE = (16, 256)
Row = dict[str, Any]


def random_prompts(
    rng: random.Random, n: int, lo: int, hi: int, vocab: int, banned: set[int]
) -> list[list[int]]:
    """`n` prompts of uniform random length in [lo, hi], ids in [100, vocab - 100)."""
    first = max(ID_MARGIN, max(banned) + 1 if banned else 0)
    last = vocab - ID_MARGIN
    if first >= last:
        raise ValueError(f"vocabulary of {vocab} ids leaves no room for random prompts")
    return [[rng.randrange(first, last) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def throughput(name: str, walls: Sequence[float], prompts: Sequence[Sequence[int]],
               outs: Sequence[Sequence[int]]) -> Row:
    """One system's row: median wall time over the rounds and the rates it gives."""
    wall = statistics.median(walls)
    gen = sum(len(o) for o in outs)
    total = gen + sum(len(p) for p in prompts)
    return {"system": name, "wall_s": wall, "wall_samples_s": list(walls), "gen_tokens": gen,
            "total_tokens": total, "gen_tok_s": gen / wall, "total_tok_s": total / wall}


def agreement(mine: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]],
              k: int | None = None) -> Row:
    """Requests (first k, or all) with identical tokens; {request: first differing position}."""
    firsts: list[int | None] = []
    for a, b in zip(mine[:k], theirs[:k], strict=True):
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                           None if len(a) == len(b) else min(len(a), len(b))))
    return {"checked": len(firsts), "equal": sum(f is None for f in firsts),
            "first_divergence": {i: f for i, f in enumerate(firsts) if f is not None}}
