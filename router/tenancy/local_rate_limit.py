"""The per-replica rate limiter: what a router enforces on its own while Redis is down.

Role: the same GCRA and lease rules as `router/tenancy/rate_limit.lua`, in process memory, with
every limit divided by the number of router replicas (`--router-replicas`, which the Helm
chart sets to its replica count): N replicas each allowing limit / N add up to the limit
when traffic is spread evenly, so the fleet is neither unlimited nor refusing everything
while Redis is away.

Invariants: the clock is injected (ms), so tests are exact; a refused admission changes
nothing; a request larger than the replica's share of the token bucket but within the
tenant's whole bucket is still admitted when the share is full (charged whole, it puts the
share into debt), so splitting the limit never refuses what the shared limit would allow.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.tenancy.rate_limit_types import Admission, Bucket, Rates


def wall_clock_ms() -> float:
    return time.time() * 1000.0


@dataclass
class _TenantState:
    request_tat: float = 0.0
    token_tat: float = 0.0
    leases: dict[str, float] = field(default_factory=dict)  # lease id -> expiry (ms)


class LocalRateLimiter:
    def __init__(self, replicas: int = 1, clock: Callable[[], float] = wall_clock_ms,
                 lease_ttl_ms: int = 120_000) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        self.replicas = replicas
        self._clock = clock
        self._lease_ttl_ms = lease_ttl_ms
        self._tenants: dict[str, _TenantState] = {}

    def admit(self, tenant: str, rates: Rates, tokens: int, whole_token_burst: int,
              lease_id: str) -> Admission:
        now = self._clock()
        state = self._tenants.setdefault(tenant, _TenantState())
        request_tat = max(state.request_tat, now)
        token_tat = max(state.token_tat, now)
        refused, retry = None, 0.0
        new_request_tat, new_token_tat = request_tat, token_tat
        if rates.request_ms:
            new_request_tat = request_tat + rates.request_ms
            wait = new_request_tat - rates.request_burst * rates.request_ms - now
            if wait > 0:
                refused, retry, new_request_tat = "requests", wait, request_tat
        if refused is None and rates.token_ms:
            if tokens > whole_token_burst:
                return self._refused(tenant, "tokens", None, rates, request_tat, token_tat, now)
            fits = min(tokens, rates.token_burst)  # see the module docstring
            wait = token_tat + fits * rates.token_ms - rates.token_burst * rates.token_ms - now
            if wait > 0:
                refused, retry = "tokens", wait
            else:
                new_token_tat = token_tat + tokens * rates.token_ms
        if rates.max_concurrent:
            state.leases = {k: v for k, v in state.leases.items() if v > now}
            if refused is None and len(state.leases) >= rates.max_concurrent:
                refused, retry = "concurrency", 1000.0
        if refused is not None:
            return self._refused(tenant, refused, math.ceil(retry), rates, request_tat,
                                 token_tat, now)
        state.request_tat, state.token_tat = new_request_tat, new_token_tat
        if rates.max_concurrent:
            state.leases[lease_id] = now + self._lease_ttl_ms
        return Admission(True, None, 0, *_buckets(rates, new_request_tat, new_token_tat, now),
                         lease_id=lease_id, backend="local")

    def finish(self, tenant: str, rates: Rates, generated_tokens: int, lease_id: str) -> None:
        state = self._tenants.get(tenant)
        if state is None:
            return
        if rates.token_ms and generated_tokens > 0:
            state.token_tat = max(state.token_tat, self._clock()) + (
                generated_tokens * rates.token_ms
            )
        state.leases.pop(lease_id, None)

    def _refused(self, tenant: str, limit: str, retry_ms: int | None, rates: Rates,
                 request_tat: float, token_tat: float, now: float) -> Admission:
        return Admission(False, limit, retry_ms, *_buckets(rates, request_tat, token_tat, now),
                         backend="local")


def _buckets(rates: Rates, request_tat: float, token_tat: float,
             now: float) -> tuple[Bucket | None, Bucket | None]:
    requests = tokens = None
    if rates.request_ms:
        requests = _bucket(rates.request_burst, rates.request_ms, request_tat, now)
    if rates.token_ms:
        tokens = _bucket(rates.token_burst, rates.token_ms, token_tat, now)
    return requests, tokens


def _bucket(burst: int, interval: float, tat: float, now: float) -> Bucket:
    remaining = max(0, math.floor((burst * interval - (tat - now)) / interval + 1e-9))
    return Bucket(burst, remaining, math.ceil(max(0.0, tat - now)))
