"""Weighted fair share between tenants inside one engine, in the manner of VTC.

Role: the scheduler asks `FairShare` two things each step: in which order waiting requests
are admitted (`admission_order`) and which running prompts should give way this step
(`deferred`), and tells it what each step computed (`charge`). Each tenant has a virtual
counter of the service it received: tokens computed for it (prompt chunks and generated
tokens; prefix-cache hits are free) divided by its weight. Where tenants compete, the one
with the smallest counter goes first. This is the Virtual Token Counter of Sheng et al.,
"Fairness in Serving Large Language Models" (OSDI '24); see docs/tenants.md for why it,
and not DLPM's locality-bounded variant, is what runs here.

Invariants:
- Priority still comes first: order is (priority, counter, newcomer, arrival). Within one
  tenant the order is exactly the FCFS one, so a single tenant schedules as before.
- A tenant that arrives (no request of it queued or running) has its counter lifted to at
  least the smallest counter of the tenants present, so idling banks no credit (VTC's lift).
  The lift makes it tie with the least served tenant; ties go to the tenant that became
  active most recently, so a tenant returning from idle is served in the next step rather
  than one step later (one step of a long-prompt flood is seconds on a CPU).
- Work-conserving: deferring a running prompt only moves it behind others within the step;
  the scheduler gives it whatever budget is left (`engine.core.scheduler`), so a lone
  tenant still gets the whole engine.
- Decodes are never deferred: one token per running request costs little and keeps every
  tenant's inter-token latency; only prompt chunks (many tokens) compete.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.core.request import Request, TenantShare

__all__ = ["FairShare", "TenantShare", "tenant_name", "tenant_of", "weight_of"]


def tenant_name(share: TenantShare | None, cache_salt: str | None) -> str:
    """The tenant of a request with this share and salt (before it is a `Request`)."""
    if share is not None:
        return share.name
    return cache_salt or ""  # the router's salt is the tenant


def tenant_of(request: Request) -> str:
    return tenant_name(request.share, request.cache_salt)


def weight_of(request: Request) -> float:
    weight = request.share.weight if request.share is not None else 1.0
    return weight if weight > 0 else 1.0


class FairShare:
    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        # Arrival number of the request that made each tenant active (ties: latest first).
        self.active_since: dict[str, int] = {}

    def on_arrival(self, request: Request, present: Iterable[Request]) -> None:
        tenant = tenant_of(request)
        others = {tenant_of(r) for r in present if r is not request}
        counter = self.counters.get(tenant, 0.0)
        if tenant not in others:
            self.active_since[tenant] = request.arrival_seq
            active = [self.counters.get(t, 0.0) for t in others]
            if active:
                counter = max(counter, min(active))
        self.counters[tenant] = counter

    def charge(self, scheduled: Iterable[tuple[Request, int]]) -> None:
        for request, num_tokens in scheduled:
            tenant = tenant_of(request)
            self.counters[tenant] = (
                self.counters.get(tenant, 0.0) + num_tokens / weight_of(request)
            )

    def key(self, request: Request) -> tuple[int, float, int, int]:
        tenant = tenant_of(request)
        return (request.priority, self.counters.get(tenant, 0.0),
                -self.active_since.get(tenant, 0), request.arrival_seq)

    def admission_order(self, waiting: Sequence[Request]) -> list[Request]:
        return sorted(waiting, key=self.key)

    def deferred(self, running: Sequence[Request], waiting: Sequence[Request]) -> set[int]:
        """ids (id()) of running requests whose prompt chunk should wait for a tenant that
        received less service (or has a better priority) and has prompt work too."""
        prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        if not prefilling or len({tenant_of(r) for r in [*prefilling, *waiting]}) < 2:
            return set()
        best = min([*prefilling, *waiting], key=self.key)
        best_tenant, best_rank = tenant_of(best), self.key(best)[:3]
        return {id(r) for r in prefilling
                if tenant_of(r) != best_tenant and self.key(r)[:3] > best_rank}
