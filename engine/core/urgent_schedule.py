"""The scheduler's half of an urgent step (engine.core.urgent_step): a step of only some newly
added requests, scheduled while another step is paused between two layers of its forward pass.

Invariants (what makes running it inside a paused step sound):
- Only the given requests move (waiting -> running, with new blocks); the paused step's
  requests, their blocks and the queues' other members are not touched, so the paused step's
  `SchedulerOutput` stays exactly what its forward pass and `update_from_output` expect.
- No preemption and no swap-in: a request that does not fit keeps waiting for the next
  ordinary step. Allocation may evict only free cached blocks (reference count 0), which no
  request of the paused step holds.
- No prefix hit on, and no admission that would recompute, a block the paused step is
  computing: such a block is not cached until that step completes (engine.core.scheduler),
  and a request whose first uncached block is among them waits (`admit_one` returns 0).
- Fair-share counters are charged for what the urgent step computes, as for any step.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from kvfleet.contracts.block_hash import BlockHash


def schedule_urgent(
    scheduler: Scheduler, requests: Sequence[Request], paused: SchedulerOutput | None
) -> SchedulerOutput:
    """Admit `requests` (all waiting) in fair-share order (FCFS without fair share) with a
    token budget of their own; the paused step is `paused` (None: between two steps)."""
    out = SchedulerOutput()
    waiting = {id(r) for r in scheduler.waiting}
    for request in requests:
        if id(request) not in waiting:
            raise ValueError(f"request {request.request_id!r} is not waiting")
    if scheduler.swapped:
        return out  # waiting requests wait while any is swapped (vLLM's rule)
    computing: set[BlockHash] = set()
    for item in [] if paused is None else paused.scheduled:
        scheduler.note_computing(item.request, item.num_new_tokens, computing)
    fair_share = scheduler.fair_share
    order = (
        fair_share.admission_order(requests)
        if fair_share is not None
        else sorted(requests, key=lambda r: r.sort_key)
    )
    budget = scheduler.config.max_num_batched_tokens
    for request in order:
        if budget <= 0 or scheduler.num_running >= scheduler.config.max_num_seqs:
            break
        admitted = scheduler.admit_one(request, budget, computing, out)
        if admitted is None:
            break
        budget -= admitted
    if fair_share is not None:
        fair_share.charge((s.request, s.num_new_tokens) for s in out.scheduled)
    return out
