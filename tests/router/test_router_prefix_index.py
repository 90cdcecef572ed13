"""The one-round-trip Lua lookup against a real Redis server, written as engines write it.

The registry and block sets are written here with plain Redis commands following
kvfleet/contracts/redis_schema.py, so the script is checked against the schema, not against itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis

from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.redis_server import RedisServer
from router.routing.prefix_index import (
    BLOCKS_KEY_PREFIX,
    ENGINE_KEY_PREFIX,
    MATCH_CHUNK,
    EngineRecord,
    PrefixIndex,
    PrefixIndexConfig,
    PrefixIndexUnavailable,
)

PROMPT = list(range(1000, 1000 + 16 * 200))  # 200 blocks: more than one SMISMEMBER chunk


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


def register(client: redis.Redis, engine_id: str, epoch: str, hashes: list[bytes],
             block_size: int = 16, **load: object) -> None:
    client.sadd(redis_schema.ENGINES_SET, engine_id)
    fields = {"address": f"127.0.0.1:{len(engine_id)}", "epoch": epoch,
              "block_size": block_size, "num_running": 0, "num_waiting": 0,
              "kv_cache_usage": 0.0, **load}
    client.hset(redis_schema.engine_key(engine_id), mapping=fields)  # type: ignore[arg-type]
    client.expire(redis_schema.engine_key(engine_id), redis_schema.REGISTRY_TTL_S)
    if hashes:
        client.sadd(redis_schema.blocks_key(engine_id, epoch), *hashes)


def lookup(url: str, block_size: int, hashes: list[bytes]) -> dict[str, tuple[int, int]]:
    async def run() -> dict[str, tuple[int, int]]:
        index = PrefixIndex(url)
        try:
            records = await index.lookup(block_size, hashes)
        finally:
            await index.close()
        return {r.engine_id: (r.matched_blocks, r.num_cached_blocks) for r in records}

    return asyncio.run(run())


def test_key_prefixes_follow_the_schema() -> None:
    assert redis_schema.engine_key("e1") == ENGINE_KEY_PREFIX + "e1"
    assert f"{BLOCKS_KEY_PREFIX}e1:ep" == redis_schema.blocks_key("e1", "ep")
    assert len(PROMPT) // 16 > MATCH_CHUNK


def test_leading_matches_per_live_engine(client: redis.Redis, redis_server: RedisServer) -> None:
    hashes = hash_token_blocks(PROMPT, 16, cache_salt="t1")
    register(client, "full", "1", hashes)
    register(client, "half", "1", hashes[:100] + hashes[150:])  # a gap: only 100 lead
    register(client, "other-tenant", "1", hash_token_blocks(PROMPT, 16, cache_salt="t2"))
    register(client, "stale-epoch", "2", [])
    client.sadd(redis_schema.blocks_key("stale-epoch", "1"), *hashes)
    client.sadd(redis_schema.ENGINES_SET, "dead")  # in the set, but no registry hash
    assert lookup(redis_server.url, 16, hashes) == {
        "full": (200, 200),
        "half": (100, 150),
        "other-tenant": (0, 200),
        "stale-epoch": (0, 0),
    }


def test_block_size_mismatch_matches_nothing(client: redis.Redis, redis_server: RedisServer
                                             ) -> None:
    hashes = hash_token_blocks(PROMPT, 16, cache_salt="t1")
    register(client, "e32", "1", hashes, block_size=32)
    assert lookup(redis_server.url, 16, hashes) == {"e32": (0, 200)}
    assert lookup(redis_server.url, 32, hashes) == {"e32": (200, 200)}


def test_load_fields_come_back(client: redis.Redis, redis_server: RedisServer) -> None:
    register(client, "e1", "7", [], num_running=3, num_waiting=2, kv_cache_usage=0.25,
             model="m")

    async def run() -> None:
        index = PrefixIndex(redis_server.url)
        try:
            (record,) = await index.lookup(16, [])
        finally:
            await index.close()
        assert (record.epoch, record.block_size, record.model) == ("7", 16, "m")
        assert record.int_field("num_running") == 3 and record.int_field("num_waiting") == 2
        assert record.float_field("kv_cache_usage") == 0.25

    asyncio.run(run())


def test_lookup_connections_skip_client_setinfo(client: redis.Redis,
                                                redis_server: RedisServer) -> None:
    """A burst of requests opens many pool connections; none announces the library with
    CLIENT SETINFO (a round trip, and a package-metadata lookup, per connection). Redis 7.2+
    would list a lib-name; older servers refuse the command, which counts an error reply."""
    register(client, "e1", "7", [], model="m")
    errors_before = client.info("stats")["total_error_replies"]

    async def run() -> None:
        index = PrefixIndex(redis_server.url)
        try:
            await asyncio.gather(*(index.lookup(16, []) for _ in range(8)))
            listed = client.client_list()
        finally:
            await index.close()
        others = [c for c in listed if c["id"] != str(client.client_id())]
        assert others, listed
        assert all(c.get("lib-name", "") == "" for c in others)

    asyncio.run(run())
    assert client.info("stats")["total_error_replies"] == errors_before


def test_redis_down_raises_quickly() -> None:
    stopped = RedisServer().start()
    url = stopped.url
    stopped.stop()

    async def run() -> None:
        index = PrefixIndex(url, PrefixIndexConfig(connect_timeout_s=0.2, read_timeout_s=0.2))
        try:
            with pytest.raises(PrefixIndexUnavailable):
                await asyncio.wait_for(index.lookup(16, [b"x" * 16]), 2.0)
        finally:
            await index.close()

    asyncio.run(run())


def test_a_hash_of_another_width_is_refused_by_name() -> None:
    """The hashes travel as one argument of 16-byte entries: a wrong one must not shift the
    rest (refused before any Redis call, so no server is needed)."""

    async def run() -> None:
        index = PrefixIndex("redis://127.0.0.1:1")
        try:
            with pytest.raises(ValueError, match="hashes: every block hash must be 16 bytes"):
                await index.lookup(16, [b"x" * 16, b"short"])
            with pytest.raises(ValueError, match="hashes"):
                await index.mark_pending("e1", "0", [b"y" * 17], 1.0)
        finally:
            await index.close()

    asyncio.run(run())


def test_registry_counts_parse_integers_decimals_and_refuse_the_rest() -> None:
    """Counts are read with int() first (engines publish integer strings); a decimal still
    reads as its integer part, and a value that is no finite number reads as the default."""
    fields = {"a": "42", "b": "7.9", "c": "-3", "d": "nan", "e": "inf", "f": "x", "g": ""}
    record = EngineRecord("e1", 0, 0, fields)
    assert [record.int_field(k, -1) for k in "abcdefg"] == [42, 7, -3, -1, -1, -1, -1]
    assert record.int_field("missing", 5) == 5
    assert EngineRecord("e1", 0, 0, {"block_size": "16"}).block_size == 16
    assert EngineRecord("e1", 0, 0, {"block_size": "1e400"}).block_size is None
