"""Batched sampling with per-request parameters.

Every row of the logits belongs to one request. Greedy rows take the argmax. Other rows are
tempered, filtered (top-k, top-p, min-p) and sampled with the exponential race
(argmax(p / q), q ~ Exp(1)): a row's draw depends only on its own generator, so a seeded request
produces the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    # A per-request generator for seeded requests; None uses the engine's generator.
    generator: torch.Generator | None
    # Tokens that must not be sampled now (EOS and stop tokens before min_tokens).
    banned_token_ids: tuple[int, ...] = ()


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        logits = logits.float()
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, list(row.banned_token_ids)] = float("-inf")
        greedy = torch.tensor([row.params.greedy for row in rows])
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            random_idx = (~greedy).nonzero().flatten()
            random_rows = [rows[i] for i in random_idx.tolist()]
            tokens[random_idx] = self._sample(logits[random_idx], random_rows)
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        temperature = torch.tensor([row.params.temperature for row in rows]).unsqueeze(1)
        logits = logits / temperature
        logits = self._filter(logits, rows)
        probs = logits.softmax(dim=-1)
        q = self._exponential_noise(probs.shape, rows)
        return (probs / q).argmax(dim=-1)

    def _filter(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        top_k = torch.tensor([vocab if r.params.top_k == -1 else r.params.top_k for r in rows])
        top_p = torch.tensor([r.params.top_p for r in rows])
        min_p = torch.tensor([r.params.min_p for r in rows])
        use_k = bool((top_k < vocab).any())
        use_p = bool((top_p < 1.0).any())
        if bool((min_p > 0).any()):
            probs = logits.softmax(dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if not (use_k or use_p):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).unsqueeze(0)
        remove = ranks >= top_k.unsqueeze(1)
        if use_p:
            sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            # Drop a token when the mass strictly before it already reaches top_p; the first
            # token is always kept.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            remove |= mass_before >= top_p.unsqueeze(1)
            remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    def _exponential_noise(self, shape: torch.Size, rows: list[SamplingRow]) -> torch.Tensor:
        q = torch.empty(shape)
        unseeded = [i for i, row in enumerate(rows) if row.generator is None]
        if unseeded:
            noise = torch.empty(len(unseeded), shape[-1]).exponential_(generator=self.generator)
            q[unseeded] = noise
        for i, row in enumerate(rows):
            if row.generator is not None:
                q[i].exponential_(generator=row.generator)
        return q
