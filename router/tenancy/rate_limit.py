"""Tenant rate limits shared by every router replica: one Redis Lua call per request.

Role: `TenantRateLimiter.admit` runs `rate_limit.lua` once when a request arrives (after
tokenizing, so the prompt's tokens are known): requests/s and tokens/min (GCRA) and
concurrent requests (leases) are checked and charged together, atomically, so N replicas
enforce the tenant's limit, not N times it. `finish` runs it once more when the request
ends: the generated tokens are charged (post-paid, as only then are they known; the bucket
may go into debt) and the lease is dropped. A background task (`run`) renews the leases of
requests still streaming, so a crashed router's leases lapse after `lease_ttl_s`.

Fallback: while Redis is unreachable (or not configured), `router.tenancy.local_rate_limit`
enforces limit / `replicas` in this process; a failed call sends this replica to the
fallback for `redis_retry_s` before Redis is tried again, so an outage costs one timeout,
not one per request. Neither unlimited nor refusing everything.

Invariants:
- Tenants without limits cost nothing: no Redis call, no lease.
- The Redis clock (TIME) is the only clock of the shared limits, so replicas with skewed
  clocks agree; tests inject `clock_ms`, which then drives both the script and the fallback.
- Keys: `kvfleet:ratelimit:{TENANT}:requests|tokens|leases` (the braces keep one tenant's
  keys in one Redis Cluster slot); all expire on their own when the tenant goes idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvfleet.contracts import redis_schema
from kvfleet.runtime.redis_access import NO_ACCESS, RedisAccess
from router.metrics import RouterMetrics
from router.routing.prefix_index import LEAN_CONNECTIONS
from router.tenancy.local_rate_limit import LocalRateLimiter, wall_clock_ms
from router.tenancy.rate_limit_types import Admission, Bucket, Rates
from router.tenancy.tenant_policy import Tenant

logger = logging.getLogger(__name__)

SCRIPT = (Path(__file__).parent / "rate_limit.lua").read_text(encoding="utf-8")
UNLIMITED = Admission(True)


@dataclass(frozen=True)
class RateLimitConfig:
    redis_url: str | None = None
    # Credentials and TLS for redis_url (kvfleet.runtime.redis_access).
    redis_access: RedisAccess = NO_ACCESS
    # Router replicas sharing the limits: the fallback enforces limit / replicas.
    replicas: int = 1
    # A lease not renewed for this long is dropped (a crashed router's requests).
    lease_ttl_s: float = 120.0
    redis_timeout_s: float = 0.5
    redis_retry_s: float = 2.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"router replicas must be at least 1, got {self.replicas}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {self.lease_ttl_s}")


def tenant_keys(tenant: str) -> list[str]:
    base = f"{redis_schema.PREFIX}:ratelimit:{{{tenant}}}"
    return [f"{base}:requests", f"{base}:tokens", f"{base}:leases"]


class TenantRateLimiter:
    def __init__(self, config: RateLimitConfig, metrics: RouterMetrics | None = None,
                 clock_ms: Callable[[], float] | None = None) -> None:
        self.config = config
        self._metrics = metrics
        self._clock_ms = clock_ms
        lease_ms = int(config.lease_ttl_s * 1000)
        self.local = LocalRateLimiter(config.replicas, clock_ms or wall_clock_ms, lease_ms)
        self._client: redis.asyncio.Redis | None = None
        self._script: Any = None
        if config.redis_url:
            self._client = redis.asyncio.Redis.from_url(
                config.redis_url, socket_timeout=config.redis_timeout_s,
                socket_connect_timeout=config.redis_timeout_s, retry=Retry(NoBackoff(), 0),
                **LEAN_CONNECTIONS, **config.redis_access.client_kwargs(config.redis_url),
            )
            self._script = self._client.register_script(SCRIPT)
        self._redis_down_until = 0.0
        self._leases: dict[str, str] = {}  # lease id -> tenant, of requests admitted by Redis

    async def admit(self, tenant: Tenant, prompt_tokens: int) -> Admission:
        """Check and charge one request; never raises for Redis trouble (falls back)."""
        limits = tenant.limits
        if not limits.rate_limited:
            return UNLIMITED
        lease_id = uuid.uuid4().hex
        whole = Rates.of(limits)
        if self._redis_usable():
            try:
                admission = await self._admit_redis(tenant.name, whole, prompt_tokens, lease_id)
            except (redis.exceptions.RedisError, OSError) as e:
                self._redis_failed(e)
            else:
                if admission.allowed and whole.max_concurrent:
                    self._leases[lease_id] = tenant.name
                return self._counted(tenant.name, admission)
        if self._metrics is not None:
            self._metrics.rate_limit_fallbacks.inc()
        share = Rates.of(limits, self.config.replicas)
        admission = self.local.admit(tenant.name, share, prompt_tokens, whole.token_burst,
                                     lease_id)
        return self._counted(tenant.name, admission)

    async def finish(self, tenant: Tenant, admission: Admission, generated_tokens: int) -> None:
        """Charge the generated tokens and drop the lease (best effort: leases also lapse)."""
        if admission.backend == "none" or not admission.allowed:
            return
        if admission.backend == "local":
            self.local.finish(tenant.name, Rates.of(tenant.limits, self.config.replicas),
                              generated_tokens, admission.lease_id)
            return
        self._leases.pop(admission.lease_id, None)
        rates = Rates.of(tenant.limits)
        try:
            await self._call("finish", tenant.name, rates, generated_tokens, admission.lease_id)
        except (redis.exceptions.RedisError, OSError) as e:
            logger.debug("rate limit finish for %s failed: %s", tenant.name, e)

    async def run(self, interval_s: float | None = None) -> None:
        """Renew the leases of requests in flight, until cancelled."""
        if self._client is None:
            return
        interval = interval_s if interval_s is not None else self.config.lease_ttl_s / 4
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                await self.renew_leases()

    async def renew_leases(self) -> None:
        if self._client is None or not self._leases:
            return
        expiry = (self._clock_ms() if self._clock_ms else time.time() * 1000) + (
            self.config.lease_ttl_s * 1000
        )
        async with self._client.pipeline(transaction=False) as pipe:
            for lease_id, tenant in list(self._leases.items()):
                pipe.zadd(tenant_keys(tenant)[2], {lease_id: expiry}, xx=True)
            await pipe.execute()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def _admit_redis(self, tenant: str, rates: Rates, tokens: int,
                           lease_id: str) -> Admission:
        raw = await self._call("admit", tenant, rates, tokens, lease_id)
        allowed, refused, retry_ms, req_left, req_reset, tok_left, tok_reset, _ = raw
        requests = tokens_bucket = None
        if rates.request_ms:
            requests = Bucket(rates.request_burst, int(req_left), int(req_reset))
        if rates.token_ms:
            tokens_bucket = Bucket(rates.token_burst, int(tok_left), int(tok_reset))
        refused_text = refused.decode() if isinstance(refused, bytes) else str(refused)
        return Admission(
            bool(allowed), refused_text or None, None if int(retry_ms) < 0 else int(retry_ms),
            requests, tokens_bucket, lease_id, "redis",
        )

    async def _call(self, mode: str, tenant: str, rates: Rates, tokens: int,
                    lease_id: str) -> Sequence[Any]:
        assert self._script is not None
        now = "" if self._clock_ms is None else repr(self._clock_ms())
        args = [mode, now, repr(rates.request_ms), rates.request_burst, repr(rates.token_ms),
                rates.token_burst, tokens, rates.max_concurrent, lease_id,
                int(self.config.lease_ttl_s * 1000)]
        result: Sequence[Any] = await self._script(keys=tenant_keys(tenant), args=args)
        return result

    def _redis_usable(self) -> bool:
        return self._client is not None and time.monotonic() >= self._redis_down_until

    def _redis_failed(self, error: BaseException) -> None:
        if time.monotonic() >= self._redis_down_until:
            logger.warning("rate limits: Redis unreachable (%s); enforcing limit / %d on this "
                           "replica for %.0f s", error, self.config.replicas,
                           self.config.redis_retry_s)
        self._redis_down_until = time.monotonic() + self.config.redis_retry_s

    def _counted(self, tenant: str, admission: Admission) -> Admission:
        if not admission.allowed and self._metrics is not None:
            self._metrics.rate_limited.labels(tenant, admission.refused or "unknown").inc()
        return admission
