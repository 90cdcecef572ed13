"""The scheduler's side of speculative decoding: which drafts a step verifies, and rollback.

A request verifies drafts only in a decode step (all its known tokens but the last are
computed): it then computes 1 + k query tokens, its last known token and k drafts. k is cut to
what the token budget, max_tokens and max_model_len leave, and is 0 when the step starts with
at least `disable_by_batch_size` running requests. The output of a request never depends on
whether it speculated (greedy: exactly; sampling: in distribution).

Rollback invariant: after a verifying step that kept `a` drafts, the request's computed
tokens are its known tokens but the last (the one correction or bonus token), exactly as after
a + 1 plain decode steps; blocks past them (holding only rejected drafts' KV) go back to the
pool. Only full blocks below `num_computed_tokens` are ever offered to the prefix cache, so a
rejected draft's KV can never become a cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.request import Request
from engine.logprobs import TokenLogprobs

if TYPE_CHECKING:
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.scheduler_output import ScheduledRequest


@dataclass(frozen=True)
class VerifiedTokens:
    """One verifying request's step result: the kept drafts, then the correction or bonus
    token (1 to k + 1 tokens); logprobs parallel to them when the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


def drafts_to_verify(
    request: Request,
    budget: int,
    num_running: int,
    disable_by_batch_size: int | None,
    kv: KVCacheManager,
    num_reserved_blocks: int,
) -> tuple[int, ...]:
    """The drafts `request` verifies this step: () when it is not decoding or cannot.

    Drafts only use free blocks beyond `num_reserved_blocks` (one per running request still
    to be scheduled in the step, in each of its block tables), so speculation never makes the
    scheduler preempt.
    """
    drafts = request.spec_token_ids
    if not drafts or request.num_computed_tokens != request.num_tokens - 1:
        return ()
    if disable_by_batch_size is not None and num_running >= disable_by_batch_size:
        return ()
    num_blocks = len(kv.req_to_blocks.get(request.request_id, ()))
    # With sliding-window KV every block of positions takes a block in each group's table.
    tables = kv.num_tables
    usable_blocks = num_blocks + max(0, kv.num_free_blocks - num_reserved_blocks * tables) // tables
    room = usable_blocks * kv.block_size - request.num_computed_tokens
    # The last known token takes one budget slot and one position; every kept draft and the
    # bonus token are outputs, which max_tokens bounds (and with it max_model_len: the
    # engine resolves max_tokens within the context).
    limit = min(
        len(drafts), budget - 1, room - 1, request.max_tokens - request.num_output_tokens - 1
    )
    return tuple(drafts[:limit]) if limit > 0 else ()


def roll_back(
    kv: KVCacheManager, request: Request, num_kept_drafts: int, num_appended: int
) -> None:
    """After a verifying step: count the kept drafts (those appended) as computed and free
    the blocks past them. Call once the step's tokens are appended and before caching."""
    request.num_computed_tokens += min(num_kept_drafts, num_appended)
    kv.free_blocks_beyond(request, request.num_computed_tokens)


def step_tokens(
    item: ScheduledRequest,
    sampled: dict[str, int],
    logprobs: dict[str, TokenLogprobs],
    verified: dict[str, VerifiedTokens],
) -> VerifiedTokens | None:
    """The tokens (and their logprobs) a scheduled request produced; None if it sampled none."""
    request_id = item.request.request_id
    if item.spec_token_ids:
        return verified[request_id]
    if request_id not in sampled:
        return None
    one = logprobs.get(request_id)
    return VerifiedTokens([sampled[request_id]], None if one is None else [one])
