"""`RedisServer` and `RedisPublisher` against a real redis-server.

The publisher's view of the engine is a real `AsyncEngine` (inside an in-process engine
server), so resync snapshots come from a real prefix cache; KV events are fed by hand to
control exactly what each step stores and evicts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from engine.core.kv_cache_manager import KVCacheEvents
from engine.service.async_engine import AsyncEngine
from engine.service.redis_publisher import EngineRegistration, RedisPublisher
from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.redis_server import RedisServer, find_redis_server, ping
from tests.fixtures.engine_harness import EngineHarness, engine_options, wait_until

H1, H2, H3, H4 = (bytes([i]) * 16 for i in range(1, 5))


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    redis_client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield redis_client
    redis_client.close()


@pytest.fixture(scope="module")
def harness(tiny_model_dir: Path, redis_server: RedisServer) -> Iterator[EngineHarness]:
    engine = EngineHarness(engine_options(tiny_model_dir, redis_server.url, "view")).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def view(harness: EngineHarness) -> AsyncEngine:
    return harness.server.async_engine


@pytest.fixture
def publisher(view: AsyncEngine) -> Iterator[Callable[..., RedisPublisher]]:
    """Factory: a started publisher for `engine_id`; closed at teardown."""
    started: list[RedisPublisher] = []

    def start(url: str, engine_id: str, heartbeat_s: float = 0.2) -> RedisPublisher:
        registration = EngineRegistration(engine_id, "10.0.0.7:50052", "tiny", 16, 256)
        pub = RedisPublisher(url, registration, view, heartbeat_s=heartbeat_s)
        pub.start()
        started.append(pub)
        return pub

    yield start
    for pub in started:
        pub.close()


def fill_cache(harness: EngineHarness, seed: int) -> list[bytes]:
    """Run one 40-token prompt through the engine; returns its (2) block hashes."""
    prompt = [3 + (seed * 7 + i) % 400 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=1)

    async def run() -> None:
        async for _ in harness.server.async_engine.generate(f"fill-{seed}", prompt, params):
            pass

    harness.call(run)
    return hash_token_blocks(prompt, 16)


def cached(harness: EngineHarness) -> set[bytes]:
    return set(harness.in_engine_thread(harness.server.async_engine.cached_block_hashes))


def members(client: redis.Redis, pub: RedisPublisher) -> set[bytes]:
    key = redis_schema.blocks_key(pub.registration.engine_id, pub.epoch)
    return cast(set[bytes], client.smembers(key))  # raw digests (decode_responses is off)


def holders(client: redis.Redis, block_hash: bytes) -> set[bytes]:
    """The engine ids the inverted index names for a hash."""
    return client.smembers(redis_schema.holders_key(block_hash))  # type: ignore[return-value]


def calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


# -- RedisServer -----------------------------------------------------------------------------


def test_redis_server_restarts_empty_on_the_same_port() -> None:
    assert os.access(find_redis_server(), os.X_OK)
    with RedisServer() as server:
        port = server.port
        assert server.url == f"redis://127.0.0.1:{port}/0"
        redis.Redis.from_url(server.url).set("k", "v")
        server.stop()
        assert not ping("127.0.0.1", port)
        server.start()
        assert server.port == port and ping("127.0.0.1", port)
        assert redis.Redis.from_url(server.url).get("k") is None  # no persistence
    assert not server.running and not ping("127.0.0.1", port)


# -- RedisPublisher --------------------------------------------------------------------------


def test_registration_heartbeat_and_deregistration(redis_server, client, publisher) -> None:
    for stale in ("old-a", "old-b"):
        client.sadd(redis_schema.blocks_key("pub-1", stale), b"x")
    unrelated = [redis_schema.blocks_key("pub-10", "e"), redis_schema.blocks_key("other", "e")]
    for key in unrelated:
        client.sadd(key, b"x")
    pub = publisher(redis_server.url, "pub-1")
    assert pub.registered.wait(5)
    assert client.keys(redis_schema.blocks_key_pattern("pub-1")) == []
    assert all(client.exists(key) for key in unrelated)
    engine_key = redis_schema.engine_key("pub-1")
    fields = {k.decode(): v.decode() for k, v in client.hgetall(engine_key).items()}
    assert fields["address"] == "10.0.0.7:50052" and fields["epoch"] == pub.epoch
    assert (fields["model"], fields["block_size"], fields["max_model_len"]) == ("tiny", "16", "256")
    assert {"num_running", "num_waiting", "kv_cache_usage", "kv_blocks_free",
            "kv_blocks_total", "updated_at"} <= fields.keys()
    assert client.sismember(redis_schema.ENGINES_SET, "pub-1")

    first_update = float(fields["updated_at"])
    time.sleep(1.2)  # several heartbeats (0.2 s) later the TTL is still fresh
    assert client.ttl(engine_key) >= redis_schema.REGISTRY_TTL_S - 1
    assert float(client.hget(engine_key, "updated_at") or 0) > first_update

    pub.on_step(KVCacheEvents(stored=[H1], removed=[]))
    wait_until(lambda: members(client, pub) == {H1})
    assert pub.deregister()
    assert not client.exists(engine_key)
    assert not client.exists(redis_schema.blocks_key("pub-1", pub.epoch))
    assert not client.sismember(redis_schema.ENGINES_SET, "pub-1")
    assert not client.exists(redis_schema.holders_key(H1))
    assert client.zscore(redis_schema.LOAD_ZSET, "pub-1") is None


def test_a_step_is_one_transaction_of_net_changes(redis_server, client, publisher) -> None:
    pub = publisher(redis_server.url, "pub-2", heartbeat_s=5.0)
    assert pub.registered.wait(5)
    sadd_before = calls(client, "sadd")
    # One step cached H1..H3 and already evicted H2 again: H2 must never be added.
    pub.on_step(KVCacheEvents(stored=[H1, H2, H3], removed=[H2]))
    wait_until(lambda: members(client, pub) == {H1, H3})
    # Both hashes in one SADD to the block set, and one SADD each to its holders set.
    assert calls(client, "sadd") - sadd_before == 3
    assert holders(client, H1) == holders(client, H3) == {b"pub-2"}
    assert not client.exists(redis_schema.holders_key(H2))
    assert calls(client, "multi") == calls(client, "exec")
    blocks_key = redis_schema.blocks_key("pub-2", pub.epoch)
    assert 0 < client.ttl(blocks_key) <= redis_schema.BLOCKS_TTL_S

    pub.on_step(KVCacheEvents(stored=[H4], removed=[H1]))
    pub.on_step(KVCacheEvents(stored=[H1], removed=[H3]))  # H1 came back: last state wins
    wait_until(lambda: members(client, pub) == {H1, H4})
    assert [holders(client, h) for h in (H1, H3, H4)] == [{b"pub-2"}, set(), {b"pub-2"}]


def test_lost_keys_are_republished_from_the_engine_cache(
    redis_server, client, publisher, harness
) -> None:
    hashes = fill_cache(harness, seed=1)
    pub = publisher(redis_server.url, "pub-3")
    wait_until(lambda: members(client, pub) == cached(harness))
    assert set(hashes) <= members(client, pub)
    client.flushall()  # as if Redis restarted without persistence
    engine_key = redis_schema.engine_key("pub-3")
    wait_until(lambda: client.exists(engine_key), timeout_s=3)
    wait_until(lambda: members(client, pub) == cached(harness), timeout_s=3)
    assert client.sismember(redis_schema.ENGINES_SET, "pub-3")


def test_a_restart_leaves_the_holders_of_blocks_it_no_longer_holds(
    redis_server, client, publisher, harness
) -> None:
    fill_cache(harness, seed=5)
    gone = b"\x01" * 16  # held by this engine id's previous epoch, not by its cache now
    client.sadd(redis_schema.blocks_key("pub-5", "old-epoch"), gone)
    client.sadd(redis_schema.holders_key(gone), "pub-5", "other")
    pub = publisher(redis_server.url, "pub-5")
    wait_until(lambda: members(client, pub) == cached(harness))
    assert holders(client, gone) == {b"other"}
    assert not client.exists(redis_schema.blocks_key("pub-5", "old-epoch"))
    assert all(b"pub-5" in holders(client, h) for h in cached(harness))
    assert client.zscore(redis_schema.LOAD_ZSET, "pub-5") is not None


def test_outage_never_blocks_the_engine_and_ends_with_a_resync(publisher, harness) -> None:
    with RedisServer() as private:
        private_client = redis.Redis.from_url(private.url, socket_timeout=5)
        pub = publisher(private.url, "pub-4")
        assert pub.registered.wait(5)
        private.stop()
        wait_until(lambda: not pub.registered.is_set())
        started = time.monotonic()
        for i in range(2000):  # events during the outage are dropped, never waited on
            pub.on_step(KVCacheEvents(stored=[i.to_bytes(16, "little")], removed=[H1]))
        # Waiting on Redis would cost a socket timeout per call (minutes for 2000); dropping
        # costs microseconds. 2 s leaves room for a loaded machine.
        assert time.monotonic() - started < 2.0
        fill_cache(harness, seed=2)
        private.start()
        wait_until(lambda: members(private_client, pub) == cached(harness), timeout_s=5)
        assert private_client.exists(redis_schema.engine_key("pub-4"))
        private.stop()
        started = time.monotonic()
        assert not pub.deregister()  # Redis gone: reports failure quickly instead of hanging
        assert time.monotonic() - started < 5
        private_client.close()


@pytest.mark.parametrize("engine_id", ["", "a:b", "a*", "x" * 129, "tenant one"])
def test_engine_ids_that_could_collide_in_key_patterns_are_refused(view, engine_id) -> None:
    registration = EngineRegistration(engine_id, "h:1", "m", 16, 256)
    with pytest.raises(ValueError, match="engine id"):
        RedisPublisher("redis://127.0.0.1:1/0", registration, view)
