"""Pending entries against a real Redis: written by one router, seen by another, then gone.

Engines are registered with plain Redis commands following kvfleet/contracts/redis_schema.py
(as tests/services/test_router_prefix_index.py does); the routers are real `PrefixIndex` /
`EngineSelector` objects, two of them standing for two replicas: `prefix_indexes` and `routers`
open them for a test's coroutine and close their Redis connections after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest
import redis

from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.redis_server import RedisServer
from router.engines.disagg import DisaggConfig, first_engine
from router.engines.pool import EnginePool
from router.routing.decision import EngineSelector, RoutingConfig
from router.routing.engine_view import EngineView
from router.routing.pending import drain
from router.routing.prefix_index import EngineRecord, PrefixIndex
from tests.unit.test_routing_replay import ENGINES, VLLM_ORDER, replay
from tests.unit.test_routing_replay import prompt as replay_prompt

BS = 16
PREFIX = list(range(1000, 1000 + 512))  # 32 blocks
TENANT = "t1"


def prompt(suffix: int) -> list[int]:
    return PREFIX + [suffix + i for i in range(32)]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


def register(client: redis.Redis, engine_id: str, epoch: str = "1",
             hashes: list[bytes] | None = None) -> None:
    client.sadd(redis_schema.ENGINES_SET, engine_id)
    client.hset(redis_schema.engine_key(engine_id), mapping={
        "address": f"127.0.0.1:{1000 + len(engine_id)}", "epoch": epoch, "block_size": BS,
        "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
        "queued_prefill_tokens": 0, "num_decoding": 0, "prefill_tokens_per_s": 1000.0,
        "decode_s_per_seq": 0.01, "updated_at": time.time(),
    })
    client.expire(redis_schema.engine_key(engine_id), redis_schema.REGISTRY_TTL_S)
    if hashes:
        client.sadd(redis_schema.blocks_key(engine_id, epoch), *hashes)


def hashes_of(ids: list[int]) -> list[bytes]:
    return hash_token_blocks(ids[:-1], BS, cache_salt=TENANT)


@contextlib.asynccontextmanager
async def prefix_indexes(url: str, count: int = 1) -> AsyncIterator[list[PrefixIndex]]:
    """`count` `PrefixIndex` connections to the Redis at `url` (one per router replica),
    closed on exit."""
    indexes = [PrefixIndex(url) for _ in range(count)]
    try:
        yield indexes
    finally:
        for index in indexes:
            await index.close()


@contextlib.asynccontextmanager
async def routers(url: str, count: int = 1) -> AsyncIterator[list[EngineSelector]]:
    """`count` router replicas: an `EngineSelector` (default routing config) on each index."""
    async with prefix_indexes(url, count) as indexes:
        yield [EngineSelector(RoutingConfig(), index, EnginePool()) for index in indexes]


async def matches(url: str, hashes: list[bytes]) -> dict[str, tuple[int, int]]:
    """What another router's lookup of `hashes` sees: engine -> (published, pending) blocks."""
    async with prefix_indexes(url) as (index,):
        records = await index.lookup(BS, hashes)
    return {r.engine_id: (r.matched_blocks, r.matched_pending_blocks) for r in records}


def test_a_pending_entry_is_seen_by_another_router_and_expires(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    hashes = hashes_of(prompt(0))
    register(client, "a", hashes=hashes[:4])  # 4 blocks published, the rest not yet
    register(client, "b")

    async def run() -> None:
        async with prefix_indexes(redis_server.url) as (writer,):
            await writer.mark_pending("a", "1", hashes[4:32], ttl_s=0.5)
            # Another router's lookup: 4 published blocks, 28 pending continuing them.
            assert await matches(redis_server.url, hashes) == {"a": (4, 28), "b": (0, 0)}
            # A shorter claim never shortens a longer one (ZADD GT).
            await writer.mark_pending("a", "1", hashes[4:32], ttl_s=0.05)
            await asyncio.sleep(0.2)
            assert await matches(redis_server.url, hashes) == {"a": (4, 28), "b": (0, 0)}
            await asyncio.sleep(0.5)
            assert await matches(redis_server.url, hashes) == {"a": (4, 0), "b": (0, 0)}

    asyncio.run(run())
    ttl = client.ttl(redis_schema.pending_key("a", "1"))
    assert 0 < ttl <= 2  # the key outlives its longest entry by a second at most


def test_a_released_claim_is_removed_and_other_epochs_never_match(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    hashes = hashes_of(prompt(0))
    register(client, "a", epoch="2")

    async def run() -> None:
        async with prefix_indexes(redis_server.url) as (writer,):
            await writer.mark_pending("a", "1", hashes, ttl_s=10)  # an old epoch's
            assert await matches(redis_server.url, hashes) == {"a": (0, 0)}
            await writer.mark_pending("a", "2", hashes, ttl_s=10)
            assert await matches(redis_server.url, hashes) == {"a": (0, 33)}
            await writer.unmark_pending("a", "2", hashes[10:])
            assert await matches(redis_server.url, hashes) == {"a": (0, 10)}

    asyncio.run(run())


def test_two_replicas_agree_and_the_second_request_follows_the_first(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    register(client, "a")
    register(client, "b")

    async def run() -> None:
        async with routers(redis_server.url, 3) as (one, two, three):
            # Replicas rank a new prefix alike (the hash decides on an idle fleet).
            first = await one.decide(prompt(0), TENANT)
            other = await three.decide(prompt(0), TENANT)
            assert [v.engine_id for v in first.ranking] == [v.engine_id for v in other.ranking]
            assert first.reason == "hash"
            assert other.claims is not None
            other.claims.cancel()  # only compared, never sent: it holds the engine no more
            chosen = first.ranking[0]
            # Replica one sends the request there (what the dispatcher does).
            assert first.claims is not None
            first.claims.claim(chosen)
            await drain()
            # Replica two's next request of the prefix follows it, before any publication.
            second = await two.decide(prompt(5000), TENANT)
            assert second.ranking[0].engine_id == chosen.engine_id
            assert second.reason == "pending"
            assert second.ranking[0].matched_pending_blocks == 32
            assert second.predicted_cached_tokens(second.ranking[0]) == 512
            assert second.reason_for(second.ranking[1].engine_id) == "retry"
            # The engine refused both: the claims are released and the prefix is cold again.
            assert second.claims is not None
            second.claims.release(second.ranking[0])
            first.claims.release(chosen)
            await drain()
            third = await two.decide(prompt(5000), TENANT)
            assert all(v.matched_pending_blocks == 0 for v in third.ranking)

    asyncio.run(run())


def test_a_replica_follows_its_own_claim_before_the_write_lands(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    register(client, "a")
    register(client, "b")

    async def run() -> None:
        async with routers(redis_server.url) as (selector,):
            first = await selector.decide(prompt(0), TENANT)
            chosen = first.ranking[0]
            assert first.claims is not None
            first.claims.claim(chosen)  # its Redis write has not run yet: no drain
            second = await selector.decide(prompt(5000), TENANT)
            assert second.ranking[0].engine_id == chosen.engine_id
            assert second.reason == "pending"
            assert second.ranking[0].matched_pending_blocks == 32
            await drain()
            # Once the write landed, Redis reports the run and the local view adds nothing.
            third = await selector.decide(prompt(6000), TENANT)
            assert third.ranking[0].matched_pending_blocks == 32
            for decision in (second, third):  # each claimed the engine when it was decided
                assert decision.claims is not None
                decision.claims.release(chosen)
            first.claims.release(chosen)
            await drain()
            fourth = await selector.decide(prompt(7000), TENANT)
            assert all(v.matched_pending_blocks == 0 for v in fourth.ranking)

    asyncio.run(run())


def test_records_carry_the_pending_match() -> None:
    record = EngineRecord("a", 1, 2, {}, 3, 4)
    assert (record.matched_host_blocks, record.matched_pending_blocks) == (3, 4)


def test_a_burst_decided_before_any_send_spreads_as_if_sent_one_by_one(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    # Rate inf: all 96 requests of the fleet benchmark are decided while none has been sent
    # (a context-window lookup, a busy event loop). Each decision holds its engine from the
    # moment it is made, so the next one sees it in flight there, with its blocks pending:
    # exactly the choices of the replay where every request was sent before the next.
    # Before the hold, a run of such decisions saw the same idle engines, and four leaders
    # went to one engine of two (the README's Fleet benchmark section).
    for engine_id in ENGINES:
        register(client, engine_id)

    async def run() -> None:
        async with routers(redis_server.url) as (selector,):
            decisions = [await selector.decide(replay_prompt(p, i), "default")
                         for i, p in enumerate(VLLM_ORDER)]
            assert [(d.ranking[0].engine_id, d.reason) for d in decisions] == replay(VLLM_ORDER)
            # Once sent (the dispatcher's claim), the hold is the pool's count: nothing twice.
            for d in decisions:
                assert d.claims is not None
                d.claims.claim(d.ranking[0])
            views = {v.engine_id: v for v in (await selector.decide(prompt(0), TENANT)).ranking}
            assert {e: (v.in_flight, v.own_prefill_tokens) for e, v in views.items()} == {
                e: (0, 0) for e in ENGINES}
            await drain()

    asyncio.run(run())


def test_a_disaggregated_decision_holds_its_prefill_engine(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    # The request goes to a prefill engine first: that engine is held from the decision
    # on, with the prompt's 544 uncached tokens, and the views carry the published context.
    for engine_id, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        register(client, engine_id)
        client.hset(redis_schema.engine_key(engine_id),
                    mapping={"role": role, "max_model_len": 4096})
    config = DisaggConfig(prefill_threshold=100)

    def first(ranking: Sequence[EngineView], lora_id: str) -> EngineView | None:
        return first_engine(ranking, len(prompt(0)), config, lora_id=lora_id)

    async def run() -> None:
        async with routers(redis_server.url) as (selector,):
            unheld = await selector.decide(prompt(0), TENANT)  # the default holds no
            assert unheld.ranking[0].role == "prefill"  # prefill engine
            assert unheld.claims is not None
            unheld.claims.cancel()
            decided = await selector.decide(prompt(0), TENANT, first=first)
            held = decided.ranking[0]
            assert (held.role, held.max_model_len) == ("prefill", 4096)
            views = {v.engine_id: v for v in (await selector.decide(prompt(9000), TENANT)).ranking}
            other = "p1" if held.engine_id == "p0" else "p0"
            assert (views[held.engine_id].in_flight, views[held.engine_id].own_prefilling,
                    views[held.engine_id].own_prefill_tokens) == (1, 1, 544)
            assert (views[other].in_flight, views["d0"].in_flight) == (0, 0)
            assert decided.claims is not None
            decided.claims.claim(held)  # sent: the hold ends, the pool counts it from now
            assert decided.claims.held_s is not None and decided.claims.held_s >= 0.0
            views = {v.engine_id: v for v in (await selector.decide(prompt(0), TENANT)).ranking}
            assert views[held.engine_id].in_flight == 0
            await drain()

    asyncio.run(run())


def test_a_prompt_shorter_than_a_block_is_held_too(
    client: redis.Redis, redis_server: RedisServer
) -> None:
    register(client, "a")

    async def run() -> None:
        async with routers(redis_server.url) as (selector,):
            short = await selector.decide(list(range(10)), TENANT)  # no full block to claim
            assert short.claims is not None
            view = (await selector.decide(list(range(10)), TENANT)).ranking[0]
            assert (view.in_flight, view.own_prefilling, view.own_prefill_tokens) == (1, 1, 10)
            await drain()

    asyncio.run(run())
