"""The scheduler's configuration and the records it hands out each step.

`SchedulerConfig` is parsed once at start; `SchedulerOutput` lists what one step computes
(`ScheduledRequest`: a request and its new query tokens, drafts included) and whom it
preempted or swapped; `RequestUpdate` is what the step did to one request. The scheduler
(engine.core.scheduler) is their only producer; the runner and the engine read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request
from engine.logprobs import TokenLogprobs


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    # "recompute", "swap" or "auto" (vLLM's preemption_mode); swap needs the KV manager's
    # swap space.
    preemption_mode: str = "recompute"
    swap_min_computed_tokens: int = 256
    # Speculative decoding (engine.spec_decode): no drafts are verified in a step that starts
    # with at least this many running requests (vLLM's disable_by_batch_size).
    spec_disable_by_batch_size: int | None = None
    # In a step that decodes, prompts get at most this many tokens between them (None or 0:
    # no cap; a decode-role engine's default, engine.core.decode_prefill_cap).
    max_prefill_tokens_per_decode_step: int | None = None
    # vLLM's names (engine.core.long_prefill_limit): a step starts at most this many long
    # prompts while others wait on a prefix it computes (None or 0: no limit); long means more
    # than the threshold of tokens left to compute (0: 4% of max_model_len).
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int = 0
    # A step that admits short prompts starts no long one (engine.core.long_prefill_limit).
    short_prefill_steps: bool = False


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    # Including the drafts: a request verifying k drafts computes 1 + k query tokens.
    num_new_tokens: int
    spec_token_ids: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens (so it samples)."""
        num_known = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.num_computed_tokens + num_known == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Every preemption victim; those preempted by swap are also in `swapped_out`.
    preempted: list[Request] = field(default_factory=list)
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True)
class RequestUpdate:
    """What one step did to one request: tokens it produced and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    # Parallel to new_token_ids when the request asked for logprobs; None otherwise.
    new_logprobs: list[TokenLogprobs] | None = None
    # On the request's first update only, when it asked for prompt_logprobs: one entry per
    # prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
