"""The model runner's side of speculative decoding: verify each request's drafts.

A verifying request's 1 + k flat rows (its last known token, then its drafts) all get logits;
row j is processed exactly as a plain decode step would process the logits of that position
(engine.worker.sampler: penalties over the tokens before it, which include drafts 1..j; EOS and stop
tokens banned while the output would still be shorter than min_tokens), then:
- greedy requests keep the drafts that equal the argmax and add the argmax after them, so
  their output is plain greedy decoding's, token for token;
- others go through the rejection sampler with their own generator (seeded requests repeat
  run to run) against the target's tempered and filtered distribution.
Logprobs, when asked for, are the raw log_softmax of each emitted token's row (as plain
decoding reports them).
Structured outputs: a constrained request's row j first loses the tokens its grammar forbids
after drafts[:j] (as plain decoding masks them), so a forbidden draft is always rejected and
the correction or bonus token is always allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.core.request import Request
from engine.spec_decode.rejection_sampler import greedy_verify, rejection_sample
from engine.spec_decode.spec_scheduling import VerifiedTokens
from engine.structured.bitmask import mask_logits
from engine.worker.sampler import Sampler, SamplingRow, gather_logprobs, plain_greedy

if TYPE_CHECKING:
    from engine.core.scheduler_output import ScheduledRequest
    from engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class VerifyRows:
    """A verifying request's flat rows [offset, offset + 1 + k)."""

    item: ScheduledRequest
    offset: int

    @property
    def num_rows(self) -> int:
        return self.item.num_new_tokens


def verify_drafts(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,
    verify_rows: list[VerifyRows],
    sampling_row: Callable[[Request], SamplingRow],
    sampler: Sampler,
    grammar_masks: dict[str, torch.Tensor] | None = None,
) -> dict[str, VerifiedTokens]:
    """Each verifying request's kept drafts plus one token, by request id.

    `grammar_masks`: for constrained requests, bool [1 + k, vocab] allowed tokens per row
    (engine.structured.manager.draft_masks), applied before anything reads the row.
    """
    grammar_masks = grammar_masks or {}
    index = torch.cat([torch.arange(v.offset, v.offset + v.num_rows) for v in verify_rows])
    bases = [sampling_row(v.item.request) for v in verify_rows]
    # Plain greedy now means plain greedy at every draft position too (nothing is banned once
    # min_tokens is reached): the rows' argmaxes are all verification needs.
    if not grammar_masks and all(plain_greedy(base) for base in bases):
        argmax = model.greedy_tokens(hidden[index.to(hidden.device)])
        if argmax is not None:
            return _verify_argmax(argmax, verify_rows)
    # On the host, like the generators the rejection sampler draws from: (1 + k) rows only.
    logits = model.compute_logits(hidden[index.to(hidden.device)]).float().cpu()
    out: dict[str, VerifiedTokens] = {}
    start = 0
    for rows, base in zip(verify_rows, bases, strict=True):
        piece = logits[start : start + rows.num_rows]
        allowed = grammar_masks.get(rows.item.request.request_id)
        if allowed is not None:
            mask_logits(piece, list(range(rows.num_rows)), allowed)
        out[rows.item.request.request_id] = _verify(piece, rows.item, base, sampler)
        start += rows.num_rows
    return out


def _verify_argmax(argmax: list[int], verify_rows: list[VerifyRows]) -> dict[str, VerifiedTokens]:
    out: dict[str, VerifiedTokens] = {}
    start = 0
    for rows in verify_rows:
        piece = argmax[start : start + rows.num_rows]
        drafts = list(rows.item.spec_token_ids)
        out[rows.item.request.request_id] = VerifiedTokens(greedy_verify(piece, drafts))
        start += rows.num_rows
    return out


def _verify(
    logits: torch.Tensor, item: ScheduledRequest, base: SamplingRow, sampler: Sampler
) -> VerifiedTokens:
    drafts = list(item.spec_token_ids)
    params = base.params
    raw = logits.log_softmax(dim=-1) if params.logprobs is not None else None
    rows = _position_rows(base, item.request, drafts)
    processed = sampler.processed_logits(logits, rows)
    if params.greedy:
        tokens = greedy_verify(processed.max(dim=-1).indices.tolist(), drafts)
    else:
        probs = sampler.target_probs(processed, rows)
        generator = base.generator if base.generator is not None else sampler.generator
        tokens = rejection_sample(probs, drafts, None, generator)
    if raw is None:
        return VerifiedTokens(tokens)
    num_top = [params.logprobs or 0] * len(tokens)
    logprobs = gather_logprobs(raw[: len(tokens)], torch.tensor(tokens), num_top)
    return VerifiedTokens(tokens, logprobs)


def _position_rows(base: SamplingRow, request: Request, drafts: list[int]) -> list[SamplingRow]:
    """Row j's sampling state as a plain decode step would see it after drafts[:j]."""
    min_tokens = base.params.min_tokens
    rows = []
    for j in range(len(drafts) + 1):
        banned = base.banned_token_ids if request.num_output_tokens + j < min_tokens else ()
        row = replace(base, banned_token_ids=banned)
        if base.params.has_penalties and j:
            row = replace(row, output_token_ids=[*request.output_token_ids, *drafts[:j]])
        rows.append(row)
    return rows
