"""Speculative decoding counters, with vLLM's names (the engine's get_stats and metrics).

num_drafts: verifying steps of requests; num_draft_tokens: drafts verified; num_accepted_tokens:
drafts kept; num_accepted_tokens_per_pos[i]: how often draft i + 1 was kept. Acceptance rate
= accepted / draft tokens; mean accepted length = 1 + accepted / drafts (tokens per verifying
step, the bonus or correction included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.scheduler_output import ScheduledRequest
from engine.spec_decode.spec_scheduling import VerifiedTokens


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(
        self, scheduled: list[ScheduledRequest], verified: dict[str, VerifiedTokens]
    ) -> None:
        for item in scheduled:
            result = verified.get(item.request.request_id)
            if not item.spec_token_ids or result is None:
                continue
            num_accepted = len(result.token_ids) - 1
            self.num_drafts += 1
            self.num_draft_tokens += len(item.spec_token_ids)
            self.num_accepted_tokens += num_accepted
            for position in range(num_accepted):
                self.num_accepted_tokens_per_pos[position] += 1

    def as_dict(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for position, count in enumerate(self.num_accepted_tokens_per_pos):
            stats[f"spec_decode_num_accepted_tokens_per_pos_{position}"] = count
        return stats
