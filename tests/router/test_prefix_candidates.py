"""A large fleet's lookup by candidates (inverted index + load window) against a real Redis.

Engines are written with the engine publisher's own functions (`apply_changes`, which keeps
the inverted index, `registry_fields`, `load_score`), so what the lookup reads is what
engines write. `full_scan_max_engines=0` makes a handful of engines a "large" fleet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from engine.service.engine_state import EngineLoad
from engine.service.redis_publisher import (
    EngineRegistration,
    apply_changes,
    load_score,
    registry_fields,
)
from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.contracts.errors import NotFoundError
from kvfleet.redis_server import RedisServer
from router.engines.pool import EnginePool
from router.routing.decision import EngineSelector, RoutingConfig
from router.routing.pending import drain
from router.routing.prefix_index import LookupAnswer, PrefixIndex, PrefixIndexConfig

PROMPT = list(range(1000, 1000 + 16 * 100))  # 99 full blocks (the last token is never hashed)
HASHES = hash_token_blocks(PROMPT[:-1], 16, cache_salt="t1")
CANDIDATES = PrefixIndexConfig(full_scan_max_engines=0, candidate_window=1)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


def publish(client: redis.Redis, engine_id: str, changes: dict[bytes, bool], queued: int = 0,
            model: str = "m", updated_at: float | None = None) -> None:
    """What an engine's flush writes (resync's key clean-up aside)."""
    load = EngineLoad(num_running=0, num_waiting=0, kv_cache_usage=0.0, kv_blocks_free=100,
                      kv_blocks_total=100, queued_prefill_tokens=queued,
                      prefill_tokens_per_s=1000.0, decode_s_per_seq=0.01)
    reg = EngineRegistration(engine_id, f"{engine_id}.test:1", model, 16, 4096)
    pipe = client.pipeline(transaction=True)
    apply_changes(pipe, redis_schema.blocks_key(engine_id, "1"), changes, engine_id)
    fields = registry_fields(reg, "1", load, time.time() if updated_at is None else updated_at)
    pipe.hset(redis_schema.engine_key(engine_id), mapping=fields)
    pipe.expire(redis_schema.engine_key(engine_id), redis_schema.REGISTRY_TTL_S)
    pipe.sadd(redis_schema.ENGINES_SET, engine_id)
    pipe.zadd(redis_schema.LOAD_ZSET, {engine_id: load_score(load)})
    pipe.execute()


def held(hashes: list[bytes]) -> dict[bytes, bool]:
    return dict.fromkeys(hashes, True)


def answer(url: str, hashes: list[bytes], config: PrefixIndexConfig = CANDIDATES,
           seed: int = 0) -> LookupAnswer:
    async def run() -> LookupAnswer:
        index = PrefixIndex(url, config)
        try:
            return await index.lookup_answer(16, hashes, seed=seed)
        finally:
            await index.close()

    return asyncio.run(run())


def matches(result: LookupAnswer) -> dict[str, tuple[int, int]]:
    return {r.engine_id: (r.matched_blocks, r.matched_pending_blocks) for r in result.records}


def test_candidates_are_the_first_blocks_holders_and_the_least_loaded(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    publish(client, "full", held(HASHES), queued=5000)
    publish(client, "half", held(HASHES[:40] + HASHES[60:]), queued=4000)  # a gap at 40
    publish(client, "tail-only", held(HASHES[1:]), queued=3000)  # lacks the first block
    publish(client, "other-tenant", held(hash_token_blocks(PROMPT[:-1], 16, cache_salt="t2")),
            queued=2000)
    publish(client, "idle", {}, queued=0)
    result = answer(redis_server.url, HASHES)
    assert not result.complete
    assert matches(result) == {"full": (99, 0), "half": (40, 0), "idle": (0, 0)}
    # The same fleet read whole: every engine, the same matches.
    whole = answer(redis_server.url, HASHES, PrefixIndexConfig(full_scan_max_engines=16))
    assert whole.complete
    assert matches(whole) == {"full": (99, 0), "half": (40, 0), "tail-only": (0, 0),
                              "other-tenant": (0, 0), "idle": (0, 0)}


def test_an_eviction_removes_the_engine_from_the_blocks_holders(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    publish(client, "a", held(HASHES), queued=5000)
    publish(client, "b", held(HASHES), queued=5000)
    publish(client, "idle", {}, queued=0)
    publish(client, "a", {HASHES[0]: False}, queued=5000)  # evicted the first: matches nothing
    publish(client, "b", {HASHES[70]: False}, queued=5000)  # evicted a middle one
    assert client.smembers(redis_schema.holders_key(HASHES[0])) == {b"b"}
    assert matches(answer(redis_server.url, HASHES)) == {"b": (70, 0), "idle": (0, 0)}


def test_dead_and_stale_engines_are_not_returned_and_the_dead_are_pruned(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    publish(client, "live", held(HASHES), queued=5000)
    publish(client, "dead", held(HASHES), queued=0)
    publish(client, "hung", held(HASHES), updated_at=time.time() - 60)
    publish(client, "idle", {}, queued=100)
    client.delete(redis_schema.engine_key("dead"))  # its registry expired: it crashed
    assert matches(answer(redis_server.url, HASHES)) == {"live": (99, 0), "idle": (0, 0)}
    assert client.smembers(redis_schema.holders_key(HASHES[0])) == {b"live", b"hung"}
    assert not client.sismember(redis_schema.ENGINES_SET, "dead")
    assert client.zscore(redis_schema.LOAD_ZSET, "dead") is None


def test_an_engine_with_only_pending_blocks_is_a_candidate(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    publish(client, "busy", {}, queued=9000)
    publish(client, "idle", {}, queued=0)

    async def mark() -> None:
        index = PrefixIndex(redis_server.url, CANDIDATES)
        try:
            await index.mark_pending("busy", "1", HASHES, ttl_s=5.0)
        finally:
            await index.close()

    asyncio.run(mark())
    assert matches(answer(redis_server.url, HASHES)) == {"busy": (0, 99), "idle": (0, 0)}


def test_equally_idle_engines_are_sliced_by_the_seed(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    for i in range(10):
        publish(client, f"e{i}", {}, queued=0)
    publish(client, "busy", {}, queued=9000)
    config = PrefixIndexConfig(full_scan_max_engines=0, candidate_window=3)
    picked = {seed: sorted(matches(answer(redis_server.url, HASHES, config, seed)))
              for seed in (0, 4, 9)}
    # ZSET order among equal scores is by member: e0 < e1 < ... < e9; a slice wraps around.
    assert picked == {0: ["e0", "e1", "e2"], 4: ["e4", "e5", "e6"], 9: ["e0", "e1", "e9"]}
    publish(client, "e7", {}, queued=-10)  # one clearly less loaded: the window is the least
    assert "e7" in matches(answer(redis_server.url, HASHES, config, seed=4))


def test_a_model_no_candidate_serves_is_looked_up_in_the_whole_fleet(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    publish(client, "holder", held(HASHES), queued=0)
    publish(client, "idle", {}, queued=0)
    publish(client, "other-model", {}, queued=9000, model="m2")

    async def decide(model: str) -> str:
        index = PrefixIndex(redis_server.url, CANDIDATES)
        selector = EngineSelector(RoutingConfig(), index, EnginePool())
        try:
            decision = await selector.decide(PROMPT, "t1", model)
            return decision.ranking[0].engine_id
        finally:
            await drain()
            await index.close()

    assert asyncio.run(decide("m")) == "holder"
    assert asyncio.run(decide("m2")) == "other-model"
    with pytest.raises(NotFoundError, match="m3"):
        asyncio.run(decide("m3"))
