"""An engine service with a host KV tier, against a real Redis: evicted prefix blocks move
from the engine's device set to its host set, a returning prompt reloads them (reported as
cached tokens), and the Prometheus metrics count the tier's traffic.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.redis_server import RedisServer
from tests.fixtures.engine_harness import EngineHarness, engine_options, wait_until


@pytest.fixture(scope="module")
def harness(tiny_model_dir: Path, redis_server: RedisServer) -> Iterator[EngineHarness]:
    # 4 device blocks (64 tokens): one 50-token prompt evicts everything cached before it.
    options = engine_options(
        tiny_model_dir, redis_server.url, "tiered", num_kv_blocks=4, max_model_len=64,
        num_host_kv_blocks=16,
    )
    engine = EngineHarness(options).start()
    yield engine
    engine.stop()


def generate(harness: EngineHarness, request_id: str, prompt: list[int]) -> int:
    """Run one prompt to its end; returns its num_cached_tokens."""
    params = SamplingParams(temperature=0, max_tokens=1)
    cached = []

    async def run() -> None:
        async for out in harness.server.async_engine.generate(request_id, prompt, params):
            if out.finished:
                cached.append(out.num_cached_tokens)

    harness.call(run)
    return cached[0]


def test_evicted_blocks_move_to_the_host_set_and_reload(harness, redis_server) -> None:
    client = redis.Redis.from_url(redis_server.url)
    epoch = _epoch(harness)
    device_key = redis_schema.blocks_key("tiered", epoch)
    host_key = redis_schema.host_blocks_key("tiered", epoch)

    def members(key: str) -> set[bytes]:
        return cast(set[bytes], client.smembers(key))

    chat = [7 + i % 300 for i in range(40)]
    chat_blocks = set(hash_token_blocks(chat, 16))
    assert generate(harness, "turn-1", chat) == 0
    wait_until(lambda: chat_blocks <= members(device_key))
    generate(harness, "other", [400 + i for i in range(50)])  # evicts the chat's blocks
    wait_until(lambda: chat_blocks <= members(host_key) and not chat_blocks & members(device_key))

    assert generate(harness, "turn-2", chat) == 32  # both blocks reloaded, not computed
    wait_until(lambda: chat_blocks <= members(device_key))
    stats = harness.in_engine_thread(harness.server.async_engine.engine.get_stats)
    assert stats["host_cache_hits"] == 2 and stats["prefix_cache_host_hits"] == 32
    assert stats["kv_transfer_bytes_to_device"] > 0
    registry = harness.server.metrics.registry
    assert registry.get_sample_value(
        "kvfleet:host_cache_hits_total", {"model_name": _model(harness)}
    ) == 2
    assert registry.get_sample_value(
        "kvfleet:kv_transfer_bytes_total",
        {"model_name": _model(harness), "direction": "to_device"},
    ) == stats["kv_transfer_bytes_to_device"]
    client.close()


def _model(harness: EngineHarness) -> str:
    return harness.server.metrics._model  # noqa: SLF001


def _epoch(harness: EngineHarness) -> str:
    publisher = harness.server._publisher  # noqa: SLF001 - the epoch is only known there
    assert publisher is not None
    return publisher.epoch
