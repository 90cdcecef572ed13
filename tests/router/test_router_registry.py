"""The engine registry as routers read it, against a real Redis server: expiry, heartbeats, pool.

Registry entries are written with plain Redis commands following kvfleet/contracts/redis_schema.py.
`CLIENT PAUSE ... WRITE` holds other clients' scripts server-side for a set time (connection
handshakes still go through), which is how these tests make lookups pile up (a burst) or hold
a connection (a busy pool) without timing races: the lookups are issued while Redis is
paused, so none can finish before it resumes. The pause stays well below the lookups' read
timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis

from kvfleet.contracts import redis_schema
from kvfleet.redis_server import RedisServer
from router.engines.discovery import DiscoveryConfig, EngineDiscovery
from router.engines.pool import EnginePool
from router.metrics import RouterMetrics
from router.routing.decision import EngineSelector, RoutingConfig
from router.routing.pending import drain
from router.routing.prefix_index import (
    EngineRecord,
    PrefixIndex,
    PrefixIndexBusy,
    PrefixIndexConfig,
)
from router.routing.ranking import Policy
from router.server import RouterConfig, parse_args

PAUSE_MS = 300


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


def pause(client: redis.Redis) -> None:
    client.client_pause(PAUSE_MS, all=False)


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


def register(client: redis.Redis, engine_id: str, updated_at: float | None = None,
             model: str = "m") -> None:
    """An engine's registry entry, as its publisher writes it (heartbeat now by default)."""
    fields = {"address": f"10.0.0.{len(engine_id)}:50052", "epoch": "1", "block_size": 16,
              "model": model, "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
              "updated_at": repr(redis_now(client) if updated_at is None else updated_at)}
    client.hset(redis_schema.engine_key(engine_id), mapping=fields)  # type: ignore[arg-type]
    client.expire(redis_schema.engine_key(engine_id), redis_schema.REGISTRY_TTL_S)
    client.sadd(redis_schema.ENGINES_SET, engine_id)


def live_ids(url: str, config: PrefixIndexConfig | None = None) -> set[str]:
    async def run() -> set[str]:
        index = PrefixIndex(url, config)
        try:
            return {r.engine_id for r in await index.lookup(16, [])}
        finally:
            await index.close()

    return asyncio.run(run())


def members(client: redis.Redis) -> set[str]:
    return {m.decode() for m in client.smembers(redis_schema.ENGINES_SET)}  # type: ignore[union-attr]


def test_engines_whose_entry_expired_leave_the_engines_set(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    register(client, "live")
    client.sadd(redis_schema.ENGINES_SET, "crashed-1", "crashed-2")  # hashes expired
    assert live_ids(redis_server.url) == {"live"}
    assert members(client) == {"live"}


def test_a_stale_heartbeat_is_not_live_until_the_next_one(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    stale_after = redis_schema.DEFAULT_STALE_AFTER_S
    register(client, "fresh")
    register(client, "hung", updated_at=redis_now(client) - stale_after - 1)
    assert live_ids(redis_server.url) == {"fresh"}
    assert members(client) == {"fresh", "hung"}  # skipped, not removed: it may come back
    assert live_ids(redis_server.url, PrefixIndexConfig(stale_after_s=0)) == {"fresh", "hung"}
    register(client, "hung")  # its next heartbeat
    assert live_ids(redis_server.url) == {"fresh", "hung"}


def test_a_burst_of_lookups_waits_for_connections_instead_of_failing(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    register(client, "e1")

    async def run() -> list[list[EngineRecord] | BaseException]:
        index = PrefixIndex(redis_server.url)  # the router's defaults
        try:
            pause(client)  # every lookup below is in flight at once
            return await asyncio.gather(*(index.lookup(16, []) for _ in range(300)),
                                        return_exceptions=True)
        finally:
            await index.close()

    results = asyncio.run(run())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} lookups failed, e.g. {failures[0]!r}"
    assert all([r.engine_id for r in result] == ["e1"] for result in results)  # type: ignore[union-attr]


def test_no_free_connection_in_time_is_busy_not_unavailable(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    register(client, "e1")
    config = PrefixIndexConfig(max_connections=1, pool_timeout_s=0.05)

    async def run() -> list[list[EngineRecord] | BaseException]:
        index = PrefixIndex(redis_server.url, config)
        try:
            pause(client)  # the first lookup holds the only connection
            return list(await asyncio.gather(index.lookup(16, []), index.lookup(16, []),
                                             return_exceptions=True))
        finally:
            await index.close()

    first, second = asyncio.run(run())
    assert isinstance(first, list) and [r.engine_id for r in first] == ["e1"]
    assert isinstance(second, PrefixIndexBusy)


def test_a_busy_pool_routes_on_the_last_answer_and_keeps_using_redis(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    register(client, "e1")
    register(client, "e2")
    config = PrefixIndexConfig(max_connections=1, pool_timeout_s=0.05)

    async def run() -> None:
        index = PrefixIndex(redis_server.url, config)
        metrics = RouterMetrics()
        selector = EngineSelector(RoutingConfig(), index, EnginePool(), metrics)
        prompt = list(range(3, 40))
        try:
            assert (await selector.decide(prompt, "t")).used_index
            await drain()  # the decision's pending claim, written in the background
            pause(client)
            paused, busy = await asyncio.gather(selector.decide(prompt, "t"),
                                                selector.decide(prompt, "t"))
            assert paused.used_index
            assert not busy.used_index and busy.policy is Policy.LEAST_LOAD
            assert {v.engine_id for v in busy.ranking} == {"e1", "e2"}
            assert (await selector.decide(prompt, "t")).used_index  # Redis not marked down
            assert metrics.redis_pool_timeouts._value.get() == 1
            assert metrics.redis_errors._value.get() == 0
        finally:
            await index.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engines", "10.0.0.1"], "--engines: expected HOST:PORT"),
        (["--engines", "10.0.0.1:50052,:1"], "--engines: expected HOST:PORT"),
        (["--engine-dns", "engines.svc"], "--engine-dns: expected HOST:PORT"),
        (["--redis-max-connections", "0"], "--redis-max-connections must be at least 1"),
        (["--redis-pool-timeout", "0"], "--redis-pool-timeout must be positive"),
        (["--engine-stale-after", "-1"], "--engine-stale-after must be >= 0"),
        (["--routing-candidate-window", "0"], "--routing-candidate-window must be at least 1"),
    ],
)
def test_bad_registry_flags_are_refused_by_name(flags: list[str], message: str) -> None:
    args = parse_args(["--tokenizer", "127.0.0.1:1", *flags])
    with pytest.raises(ValueError, match=message):
        RouterConfig.from_args(args)


def test_registry_flags_reach_the_config() -> None:
    args = parse_args(["--tokenizer", "127.0.0.1:1", "--engines", "10.0.0.1:1, [::1]:2",
                       "--engine-dns", "kv-engine:50052", "--redis-max-connections", "8",
                       "--redis-pool-timeout", "0.5", "--engine-stale-after", "2",
                       "--routing-candidate-window", "3"])
    config = RouterConfig.from_args(args)
    assert config.discovery.static_addresses == ("10.0.0.1:1", "[::1]:2")
    assert config.discovery.dns == "kv-engine:50052"
    assert (config.index.max_connections, config.index.pool_timeout_s,
            config.index.stale_after_s, config.index.candidate_window) == (8, 0.5, 2.0, 3)
    default = RouterConfig.from_args(parse_args(["--tokenizer", "127.0.0.1:1"]))
    assert default.index.candidate_window == 8


def test_discovery_addresses_are_normalised_and_survive_a_dns_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = DiscoveryConfig(("[::1]:5", "10.0.0.1:6", "10.0.0.1:6"),
                             dns="kvfleet-no-such-engine.invalid:50052")
    discovery = EngineDiscovery(config)

    async def twice() -> tuple[list[str], list[str]]:
        return await discovery.addresses(), await discovery.addresses()

    with caplog.at_level("WARNING", logger="router.engines.discovery"):
        first, second = asyncio.run(twice())
    assert first == second == ["10.0.0.1:6", "[::1]:5"]
    assert len([r for r in caplog.records if "could not resolve" in r.message]) == 1
