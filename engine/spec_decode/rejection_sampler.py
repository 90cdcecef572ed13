"""Verification of drafted tokens: greedy acceptance and rejection sampling.

Greedy: drafts are accepted while each equals the target's argmax at its position; the first
mismatch is replaced by that argmax (or, when all match, the argmax after the last draft is the
bonus token). The result equals plain greedy decoding token for token.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft token d_j, drawn from q_j, is kept
with probability min(1, p_j(d_j) / q_j(d_j)); the first rejected one is replaced by a draw from
norm(max(0, p_j - q_j)), and if every draft is kept a bonus token is drawn from p_{k+1}. Every
emitted token is then distributed exactly as the target would sample it. A proposer that drafts
deterministically (n-gram lookup, a greedy draft model) has q_j = one-hot(d_j): the draft is
kept with probability p_j(d_j) and a rejection draws from p_j with d_j removed.

Invariants: the output has 1 to k + 1 tokens, all but the last are the accepted drafts; every
random draw comes from the given generator, so a seeded request repeats itself run to run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def greedy_verify(target_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> list[int]:
    """Emitted tokens given the target's argmax at each of the k + 1 verified positions."""
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError("greedy_verify needs one target token per draft plus the bonus")
    out: list[int] = []
    for target, draft in zip(target_token_ids, draft_token_ids, strict=False):
        out.append(target)
        if target != draft:
            return out
    out.append(target_token_ids[-1])
    return out


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """Emitted tokens for one request.

    target_probs: [k + 1, vocab] float, the target's sampling distribution at each position
    (after penalties, temperature and top-k/top-p/min-p). draft_probs: [k, vocab], the
    proposer's distribution each draft was drawn from; None for deterministic drafts.
    """
    num_drafts = len(draft_token_ids)
    if target_probs.shape[0] != num_drafts + 1:
        raise ValueError("rejection_sample needs one target row per draft plus the bonus")
    out: list[int] = []
    for j, token in enumerate(draft_token_ids):
        p = target_probs[j]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        u = float(torch.rand((), generator=generator))
        # u < p / q without dividing: q_token > 0 since the draft was drawn from q.
        if u * q_token < float(p[token]):
            out.append(token)
            continue
        out.append(
            _draw(_residual(p, token, None if draft_probs is None else draft_probs[j]), generator)
        )
        return out
    out.append(_draw(target_probs[num_drafts], generator))
    return out


def _residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """norm(max(0, p - q)); q None means one-hot(token)."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp(min=0.0)
    # A rejection with no residual mass needs p == q up to rounding, where the rejection
    # itself had probability ~0; p is then the right distribution to draw from.
    return residual if float(residual.sum()) > 0.0 else p


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs.float(), 1, generator=generator))
