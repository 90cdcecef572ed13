"""Repetition, frequency and presence penalties on a batch of logits (vLLM's semantics).

Role: the sampler calls `apply_penalties` on the rows of requests that set a penalty, before
banned tokens, greedy argmax, temperature and top-k/p/min-p.

Invariants, per row:
- repetition_penalty r covers every token seen in the prompt OR the output: a positive logit
  is divided by r, a non-positive one multiplied by r (CTRL / transformers / vLLM); tokens not
  seen, and rows with r == 1, are left bit for bit unchanged.
- frequency_penalty f and presence_penalty p cover OUTPUT tokens only:
  logit -= f * count(token) + p * [count(token) > 0].
- A -inf logit (a banned token) stays -inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfleet.contracts.sampling_params import SamplingParams


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """float32 [len(token_ids), vocab_size]: how often each token occurs in each row's list."""
    width = max((len(ids) for ids in token_ids), default=0)
    # Pad with an out-of-vocabulary bucket (vocab_size) that is dropped afterwards, so all
    # rows go through a single scatter.
    padded = torch.tensor(
        [[*ids, *([vocab_size] * (width - len(ids)))] for ids in token_ids], dtype=torch.int64
    ).reshape(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1)
    counts.scatter_add_(1, padded, torch.ones(padded.shape))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Penalised copy of float32 `logits` [len(params), vocab]; one params/ids entry per row."""
    vocab = logits.shape[-1]
    output_counts = token_counts(output_token_ids, vocab)
    output_seen = output_counts > 0
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = output_seen | (token_counts(prompt_token_ids, vocab) > 0)
        penalty = torch.where(seen, torch.tensor(repetition).unsqueeze(1), 1.0)
        # Divide rather than multiply by 1/r: bit-identical to transformers' processor.
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    frequency = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)
    return logits - frequency * output_counts - presence * output_seen
