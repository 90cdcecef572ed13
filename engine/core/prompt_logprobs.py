"""Prompt logprobs of a request, kept between the chunks of its prefill.

Role: the scheduler stores each prefill chunk's entries as they come (`store_prompt_logprobs`)
and hands the whole list over with the first generated token (`take_prompt_logprobs`).

Invariants: entry i is the logprobs of prompt token i given the tokens before it (entry 0 is
None: nothing precedes the first token); a request asking for prompt logprobs runs without
prefix hits, so every chunk's entries arrive in order, and a prompt recomputed after
preemption overwrites its entries instead of appending them.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.logprobs import TokenLogprobs


def store_prompt_logprobs(request: Request, start: int, entries: list[TokenLogprobs]) -> None:
    """Write one chunk's entries, which start at prompt token `start + 1`."""
    pending = request.pending_prompt_logprobs
    if not pending:
        pending.append(None)  # prompt token 0: nothing precedes it
    # No prefix hits and no skipped chunk, so the entries before this chunk are all there.
    assert len(pending) >= start + 1, "prompt logprobs chunk out of order"
    # Written by position, not appended: a prompt recomputed after preemption replaces its
    # entries rather than duplicating them.
    pending[start + 1 :] = entries


def take_prompt_logprobs(request: Request) -> list[TokenLogprobs | None]:
    """Hand over the whole list with the first token; the request keeps nothing."""
    # A one-token prompt never ran a chunk with entries: its list is just [None].
    taken = request.pending_prompt_logprobs or [None]
    request.pending_prompt_logprobs = []
    assert len(taken) == request.num_prompt_tokens, "prompt logprobs incomplete"
    return taken
