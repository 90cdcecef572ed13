"""Host-tier blocks in Redis and in routing: the lookup script counts device and host
matches separately (real Redis, keys written per kvfleet/contracts/redis_schema.py), and the prefix
policy ranks a host hit between a device hit and no hit, by the documented weight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis

from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.redis_server import RedisServer
from router.routing.prefix_index import HOST_BLOCKS_KEY_PREFIX, MATCH_CHUNK, PrefixIndex
from router.routing.ranking import EngineView, PrefixPolicyConfig, rank_prefix
from tests.router.test_router_prefix_index import register

PROMPT = list(range(5000, 5000 + 16 * 150))  # 150 blocks: several SMISMEMBER chunks


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


def lookup(url: str, hashes: list[bytes]) -> dict[str, tuple[int, int]]:
    async def run() -> dict[str, tuple[int, int]]:
        index = PrefixIndex(url)
        try:
            records = await index.lookup(16, hashes)
        finally:
            await index.close()
        return {r.engine_id: (r.matched_blocks, r.matched_host_blocks) for r in records}

    return asyncio.run(run())


def test_host_key_prefix_follows_the_schema() -> None:
    assert f"{HOST_BLOCKS_KEY_PREFIX}e1:ep" == redis_schema.host_blocks_key("e1", "ep")
    assert len(PROMPT) // 16 > 2 * MATCH_CHUNK


def test_lookup_counts_device_then_host_matches(client: redis.Redis, redis_server) -> None:
    hashes = hash_token_blocks(PROMPT, 16, cache_salt="t")
    # "mixed": device holds 0-9 and 100-119, host holds 10-99 (and 0-4, also on the device).
    register(client, "mixed", "1", hashes[:10] + hashes[100:120])
    client.sadd(redis_schema.host_blocks_key("mixed", "1"), *(hashes[:5] + hashes[10:100]))
    # "host-only": no device set at all, the host tier holds 0-69.
    register(client, "host-only", "1", [])
    client.sadd(redis_schema.host_blocks_key("host-only", "1"), *hashes[:70])
    # "stale-epoch": host blocks of an old epoch never count.
    register(client, "stale-epoch", "2", [])
    client.sadd(redis_schema.host_blocks_key("stale-epoch", "1"), *hashes)
    assert lookup(redis_server.url, hashes) == {
        # 0-9 and 100-119 on the device, 10-99 from the host; the run ends at block 120.
        "mixed": (30, 90),
        "host-only": (0, 70),
        "stale-epoch": (0, 0),
    }


def test_prefix_policy_weighs_host_hits_between_device_hits_and_none() -> None:
    config = PrefixPolicyConfig()
    assert config.host_hit_weight == 0.5
    device = EngineView("device", "a:1", matched_blocks=4)
    host = EngineView("host", "a:2", matched_host_blocks=4)
    cold = EngineView("cold", "a:3")
    more_host = EngineView("more-host", "a:4", matched_host_blocks=9)  # 4.5 > 4
    ranked = rank_prefix([cold, host, device], b"k", config)
    assert [e.engine_id for e in ranked] == ["device", "host", "cold"]
    ranked = rank_prefix([device, more_host, host], b"k", config)
    assert [e.engine_id for e in ranked] == ["more-host", "device", "host"]
    only_device = PrefixPolicyConfig(host_hit_weight=0.0)
    ranked = rank_prefix([host, device], b"k", only_device)
    assert ranked[0].engine_id == "device"
    with pytest.raises(ValueError, match="host hit weight"):
        PrefixPolicyConfig(host_hit_weight=1.5)
