"""The engine's speculative decoding loop: after each step, draft for the requests that
decode next, and count what the step verified.

Drafts are (re)proposed for every request that got tokens in the step and still runs, so a
request's drafts always follow its current tokens; none are proposed while the running batch
is at or past disable_by_batch_size (they would not be verified). A proposer drafts at most
max_tokens - outputs - 1 tokens (every kept draft and the bonus token are outputs). A
request under a grammar (structured outputs) keeps only the drafts its grammar accepts; the
verifier masks each draft position with the grammar too (engine.spec_decode.verifier).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.core.request import Request
from engine.core.scheduler_output import RequestUpdate, ScheduledRequest
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.spec_config import SpeculativeConfig
from engine.spec_decode.spec_scheduling import VerifiedTokens
from engine.spec_decode.spec_stats import SpecDecodeStats


class Proposer(Protocol):
    def propose_for(self, requests: Sequence[Request]) -> None:
        """Set each request's spec_token_ids (at most its max_drafts(request))."""


class NgramRequestProposer:
    """The n-gram proposer over each request's tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose_for(self, requests: Sequence[Request]) -> None:
        for request in requests:
            request.spec_token_ids = self.ngram.propose(request.all_token_ids, max_drafts(request))


def max_drafts(request: Request) -> int:
    return request.max_tokens - request.num_output_tokens - 1


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecDecodeStats(config.num_speculative_tokens)

    def after_step(
        self,
        scheduled: list[ScheduledRequest],
        verified: dict[str, VerifiedTokens],
        updates: list[RequestUpdate],
        num_running: int,
    ) -> None:
        self.stats.observe(scheduled, verified)
        live = [u.request for u in updates if not u.finished]
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            for request in live:
                request.spec_token_ids = []
            return
        self.proposer.propose_for(live)
        for request in live:
            if request.grammar is not None and request.spec_token_ids:
                # Structured outputs: only drafts the grammar accepts are worth verifying.
                valid = request.grammar.validate_tokens(request.spec_token_ids)
                request.spec_token_ids = request.spec_token_ids[:valid]
