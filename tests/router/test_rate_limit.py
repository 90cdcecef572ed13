"""Tenant rate limits on a real Redis (the Lua script) and the per-replica fallback, with an
injected clock so every expected verdict is exact."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvfleet.redis_server import RedisServer
from router.metrics import RouterMetrics
from router.tenancy.local_rate_limit import LocalRateLimiter
from router.tenancy.rate_limit import RateLimitConfig, TenantRateLimiter
from router.tenancy.rate_limit_types import Admission, Rates, format_duration
from router.tenancy.tenant_policy import Tenant, TenantLimits


class Clock:
    def __init__(self, ms: float = 1_000_000.0) -> None:
        self.ms = ms

    def __call__(self) -> float:
        return self.ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    yield redis_server.url


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def limiter(url: str | None, clock: Clock, replicas: int = 1,
            metrics: RouterMetrics | None = None) -> TenantRateLimiter:
    return TenantRateLimiter(RateLimitConfig(url, replicas=replicas), metrics, clock_ms=clock)


def admit_many(limiters: list[TenantRateLimiter], tenant: Tenant, count: int,
               tokens: int = 1) -> list[Admission]:
    async def go() -> list[Admission]:
        results = []
        for index in range(count):
            results.append(await limiters[index % len(limiters)].admit(tenant, tokens))
        for each in limiters:
            await each.close()
        return results

    return run(go())


def test_requests_per_second_is_shared_by_two_replicas(redis_url: str, clock: Clock) -> None:
    tenant = Tenant("rps-shared", TenantLimits(requests_per_second=2, request_burst=4))
    replicas = [limiter(redis_url, clock), limiter(redis_url, clock)]
    verdicts = admit_many(replicas, tenant, 6)
    # The burst of 4 is the tenant's, not each replica's: the 5th and 6th are refused.
    assert [v.allowed for v in verdicts] == [True, True, True, True, False, False]
    assert all(v.backend == "redis" for v in verdicts)
    refused = verdicts[4]
    assert refused.refused == "requests" and refused.retry_after_ms == 500
    assert refused.requests is not None and refused.requests.remaining == 0
    assert verdicts[0].requests is not None and verdicts[0].requests.remaining == 3
    clock.ms += 500  # one request's worth of time
    assert [v.allowed for v in admit_many([limiter(redis_url, clock)], tenant, 2)] == [
        True, False]


def test_tokens_per_minute_charges_prompt_then_generated(redis_url: str, clock: Clock) -> None:
    tenant = Tenant("tpm", TenantLimits(tokens_per_minute=600))  # 10 tokens/s

    async def go() -> list[Admission]:
        a, b = limiter(redis_url, clock), limiter(redis_url, clock)
        first = await a.admit(tenant, 400)
        await a.finish(tenant, first, 150)  # 550 of 600 used
        second = await b.admit(tenant, 100)  # needs 50 more: 5 s
        too_big = await b.admit(tenant, 601)
        clock.ms += 5000
        third = await b.admit(tenant, 100)
        await a.close()
        await b.close()
        return [first, second, too_big, third]

    first, second, too_big, third = run(go())
    assert first.allowed and first.tokens is not None and first.tokens.remaining == 200
    assert not second.allowed and second.refused == "tokens"
    assert second.retry_after_ms == 5000
    assert second.headers()["retry-after"] == "5"
    assert not too_big.allowed and too_big.retry_after_ms is None
    assert "retry-after" not in too_big.headers()
    assert third.allowed and third.tokens is not None and third.tokens.remaining == 0


def test_concurrency_leases_across_replicas(redis_url: str, clock: Clock) -> None:
    tenant = Tenant("conc", TenantLimits(max_concurrent_requests=2))

    async def go() -> list[bool]:
        a, b = limiter(redis_url, clock), limiter(redis_url, clock)
        one = await a.admit(tenant, 1)
        two = await b.admit(tenant, 1)
        three = await a.admit(tenant, 1)
        await b.finish(tenant, two, 0)
        four = await a.admit(tenant, 1)
        await a.close()
        await b.close()
        assert three.refused == "concurrency"
        return [one.allowed, two.allowed, three.allowed, four.allowed]

    assert run(go()) == [True, True, False, True]


def test_lapsed_leases_free_their_slots(redis_url: str, clock: Clock) -> None:
    tenant = Tenant("lapse", TenantLimits(max_concurrent_requests=1))
    crashed = admit_many([limiter(redis_url, clock)], tenant, 2)
    assert [v.allowed for v in crashed] == [True, False]
    clock.ms += RateLimitConfig().lease_ttl_s * 1000 + 1  # the crashed router never renewed
    assert admit_many([limiter(redis_url, clock)], tenant, 1)[0].allowed


def test_redis_down_falls_back_to_limit_over_replicas(clock: Clock) -> None:
    metrics = RouterMetrics()
    tenant = Tenant("fallback", TenantLimits(requests_per_second=4, request_burst=4))
    down = limiter("redis://127.0.0.1:1/0", clock, replicas=2, metrics=metrics)
    verdicts = admit_many([down], tenant, 4)
    # limit / 2 replicas: a burst of 2 here, neither unlimited nor refusing everything.
    assert [v.allowed for v in verdicts] == [True, True, False, False]
    assert {v.backend for v in verdicts} == {"local"}
    assert metrics.registry.get_sample_value(
        "kvfleet:router_rate_limit_fallbacks_total") == 4
    assert metrics.registry.get_sample_value(
        "kvfleet:router_rate_limited_total", {"tenant": "fallback", "limit": "requests"}) == 2


def test_unlimited_tenants_never_touch_redis(clock: Clock) -> None:
    verdict = admit_many([limiter("redis://127.0.0.1:1/0", clock)], Tenant("free",
                         TenantLimits()), 1)[0]
    assert verdict.allowed and verdict.backend == "none" and verdict.headers() == {}


def test_local_limiter_matches_the_script_rules(clock: Clock) -> None:
    local = LocalRateLimiter(replicas=1, clock=clock)
    rates = Rates.of(TenantLimits(requests_per_second=1, tokens_per_minute=60))
    first = local.admit("t", rates, 50, 60, "l1")
    second = local.admit("t", rates, 1, 60, "l2")  # the request bucket (burst 1) is empty
    assert first.allowed and not second.allowed and second.retry_after_ms == 1000
    clock.ms += 1000
    third = local.admit("t", rates, 20, 60, "l3")  # 11 tokens left after 1 s: 9 s short
    assert not third.allowed and third.refused == "tokens" and third.retry_after_ms == 9000
    local.finish("t", rates, 5, "l1")


def test_reset_durations_use_openais_format() -> None:
    assert format_duration(250) == "250ms"
    assert format_duration(1000) == "1s"
    assert format_duration(360_000) == "6m0s"
    assert format_duration(6500) == "6.5s"
