"""N-gram (prompt lookup) proposer: drafts the tokens that followed the last n-gram before.

For n from prompt_lookup_max down to prompt_lookup_min, the request's last n tokens are looked
for earlier in its tokens (prompt and output); at the earliest occurrence, the up to k tokens
that followed it are the drafts (vLLM's choice: the longest n-gram, then its first position;
for input-grounded output the first occurrence is the prompt's, whose continuation is the one
the output copies). No match for any n: no drafts (the request decodes
one token as usual). Deterministic: the same tokens give the same drafts, so the rejection
sampler treats them as one-hot proposals.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """Drafts to follow `token_ids`: at most min(k, max_drafts), possibly none."""
        limit = (
            self.num_speculative_tokens
            if max_drafts is None
            else min(max_drafts, self.num_speculative_tokens)
        )
        num_tokens = len(token_ids)
        if limit <= 0 or num_tokens < self.lookup_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Windows over all but the last token, so every match has a token after it and the
        # suffix never matches itself.
        head = tokens[:-1]
        for n in range(min(self.lookup_max, num_tokens - 1), self.lookup_min - 1, -1):
            suffix = tokens[num_tokens - n :]
            matches = np.flatnonzero((sliding_window_view(head, n) == suffix).all(axis=1))
            if matches.size:
                start = int(matches[0]) + n
                return tokens[start : start + limit].tolist()
        return []
