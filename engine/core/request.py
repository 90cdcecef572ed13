"""A request inside the engine: its tokens, how many are computed, and its block hashes.

There is no prefill or decode phase: `num_computed_tokens` of `all_token_ids` have KV in the
cache and the rest still have to be computed. `block_hashes` covers every full block of
`all_token_ids` and grows as output tokens fill blocks.

Prompt logprobs: a request that asks for them owes them until its first sampled token goes
out (`needs_prompt_logprobs`); meanwhile each prefill chunk's entries are written into
`pending_prompt_logprobs` by prompt position, and the list is handed over (and emptied) with
that first token. Once delivered they are never computed again, not even when a preempted
request recomputes its prompt.

Structured outputs: `grammar` follows `output_token_ids` (advanced by the scheduler as tokens
are committed). Preemption keeps the output tokens (recompute recomputes their KV, swap keeps
it), so the matcher stays valid through both without a rollback.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.logprobs import TokenLogprobs
from kvfleet.contracts.block_hash import BlockHash, hash_token_blocks
from kvfleet.contracts.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.backend import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # preempted by swap: its KV waits in host memory
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    # A prefill-only request whose first token did not end it: a decode engine continues it
    # (engine.disagg). Its blocks are freed like any finished request's.
    FINISHED_HANDOFF = "finished_handoff"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_HANDOFF,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_HANDOFF: "handoff",
}


@dataclass(frozen=True)
class RequestTiming:
    """A request's time.monotonic() instants: queued, first scheduled, each preemption."""

    arrival_time: float
    first_scheduled_time: float | None
    preemption_times: tuple[float, ...]

    @classmethod
    def of(cls, request: Request) -> RequestTiming:
        return cls(
            request.arrival_time, request.first_scheduled_time, tuple(request.preemption_times)
        )


@dataclass(frozen=True)
class TenantShare:
    """Whom a request is served for, and that tenant's fair-share weight (> 0)."""

    name: str
    weight: float = 1.0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Resolved by the engine: max_tokens with None replaced by the remaining context.
    max_tokens: int
    block_size: int
    arrival_seq: int
    priority: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    lora_id: str | None = None
    # The tenant for fair share (engine.core.fair_share); None: the cache salt stands for it.
    share: TenantShare | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prefix-cache hit on first admission; None until the request is first scheduled.
    num_cached_tokens: int | None = None
    # Of those, tokens reloaded from the host tier rather than found on the device.
    num_host_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Steps this request, waiting as a long prompt, was passed over (the starvation bound of
    # engine.core.long_prefill_limit).
    long_prefill_waits: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    # time.monotonic() when the request entered the engine / was first scheduled (metrics,
    # tracing: queue time = first_scheduled_time - arrival_time).
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    preemption_times: list[float] = field(default_factory=list)
    # Entry i is prompt token i's logprobs (entry 0 is None: nothing precedes it); filled chunk
    # by chunk while `needs_prompt_logprobs`, emptied when handed over with the first token.
    pending_prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Speculative decoding: tokens a proposer drafted to follow `all_token_ids`, verified in
    # the request's next decode step (engine.spec_decode). Never part of all_token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured outputs (engine.structured): the matcher of this sample's constraint, which
    # has consumed exactly `output_token_ids`; None for unconstrained requests.
    grammar: GrammarMatcher | None = None
    # Disaggregation (engine.disagg): a prefill engine's request ends after its first token
    # (FINISHED_HANDOFF unless that token ends it anyway); `handoff_block_ids` are its blocks
    # at that moment, and `exported_kv` their contents, copied before anything reuses them.
    prefill_only: bool = False
    handoff_block_ids: list[int] = field(default_factory=list)
    exported_kv: object = None
    # A decode engine's request whose KV came from a prefill engine: it waits holding its
    # blocks and is admitted without a prefix lookup, its computed tokens kept.
    kv_imported: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not yet sent them (they go with the first token)."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival_seq)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        start = len(self.block_hashes)
        if (start + 1) * self.block_size > self.num_tokens:
            return
        parent = self.block_hashes[-1] if self.block_hashes else None
        self.block_hashes.extend(
            hash_token_blocks(
                self.all_token_ids,
                self.block_size,
                cache_salt=self.cache_salt,
                lora_id=self.lora_id,
                parent=parent,
                start_block=start,
            )
        )
