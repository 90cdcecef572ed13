"""The router in a real fleet: Redis server, tokenizer, 2 engines and a router, all processes.

Tiny model, greedy, few tokens: the point is where requests go and what survives failures.
Tests run in file order and share one module-scoped fleet; the destructive ones (Redis
stopped, an engine killed) come last and restore what later tests need.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
import redis

from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.fleet import Fleet
from kvfleet.router_client import build_request
from kvfleet.v1 import common_pb2
from kvfleet.v1.router_pb2 import RouterGenerateRequest
from router.engines.pool import EnginePool
from router.routing.decision import EngineSelector, RoutingConfig
from router.routing.prefix_index import PrefixIndex
from router.routing.ttft_cost import PrefixPolicyConfig
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import (
    API_KEYS,
    NUM_TENANTS,
    RouterClient,
    engine_load,
    greedy,
    tenant_prefix,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

BLOCK_SIZE = 16
TIE_TOLERANCE = 100.0
LONG_TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all afternoon. "
    "Once upon a time there was a small village by the sea, where fishermen sailed at dawn."
)


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 2,
        "api_keys": True,
        "engine_args": ("--num-kv-blocks", "256"),
        # Every idle engine ties whatever rates it measured (noisy on a busy 2-core runner):
        # the prefix held, then the prompt's hash, decides, which is what these tests check.
        "router_args": ("--tie-tolerance", str(TIE_TOLERANCE)),
    }


def key(index: int) -> str:
    return API_KEYS[f"tenant-{index}"]


def user_turn(index: int, turn: int) -> list[int]:
    return [3 + (index * 7 + turn * 3 + j) % 500 for j in range(8)]


def wait_for_blocks(redis_client: redis.Redis, engine_id: str, ids: list[int],
                    tenant: str) -> None:
    """Until the engine's published block set holds the prompt's blocks (router's hashes)."""
    hashes = hash_token_blocks(ids[:-1], BLOCK_SIZE, cache_salt=tenant)
    blocks = current_blocks_key(redis_client, engine_id)
    wait_until(lambda: all(redis_client.smismember(blocks, hashes)), 10,
               what=f"{engine_id} to publish {len(hashes)} blocks")


def current_blocks_key(redis_client: redis.Redis, engine_id: str) -> str:
    epoch = redis_client.hget(redis_schema.engine_key(engine_id), "epoch")
    assert isinstance(epoch, bytes)
    return redis_schema.blocks_key(engine_id, epoch.decode())


def wait_for_num_blocks(redis_client: redis.Redis, engine_id: str, num_blocks: int) -> None:
    blocks = current_blocks_key(redis_client, engine_id)
    wait_until(lambda: redis_client.scard(blocks) >= num_blocks, 10,
               what=f"{engine_id} to publish {num_blocks} blocks")


def test_same_prefix_lands_on_the_same_engine_with_cached_tokens(
    client: RouterClient, redis_client: redis.Redis
) -> None:
    request = build_request(LONG_TEXT, params=greedy())
    first = client.generate(request, key(0))
    assert first.finish_reason == "length" and first.num_cached_tokens == 0
    num_prompt_tokens = first.usage["prompt_tokens"]
    assert num_prompt_tokens > 3 * BLOCK_SIZE
    # Every full block but the one holding the last prompt token (always computed).
    num_blocks = (num_prompt_tokens - 1) // BLOCK_SIZE
    wait_for_num_blocks(redis_client, first.engine_id, num_blocks)
    for _ in range(3):
        again = client.generate(request, key(0))
        assert again.engine_id == first.engine_id
        assert again.num_cached_tokens == num_blocks * BLOCK_SIZE
        assert again.text == first.text


def test_another_tenant_with_the_same_prompt_gets_no_cached_tokens(
    client: RouterClient,
) -> None:
    request = build_request(LONG_TEXT, params=greedy())
    other = client.generate(request, API_KEYS["other"])
    assert other.num_cached_tokens == 0
    assert client.generate(request, API_KEYS["other"]).num_cached_tokens > 0


def test_tenants_spread_over_both_engines_and_stick(
    client: RouterClient, redis_client: redis.Redis
) -> None:
    placement = {}
    for i in range(NUM_TENANTS):
        ids = tenant_prefix(i) + user_turn(i, 0)
        placement[i] = client.generate_ids(ids, key(i)).engine_id
        wait_for_blocks(redis_client, placement[i], ids, f"tenant-{i}")
    assert set(placement.values()) == {"engine-0", "engine-1"}, placement
    for i in range(NUM_TENANTS):
        again = client.generate_ids(tenant_prefix(i) + user_turn(i, 1), key(i))
        assert again.engine_id == placement[i]
        assert again.num_cached_tokens == len(tenant_prefix(i)), i


def test_a_restarted_router_routes_as_before(fleet: Fleet, client: RouterClient) -> None:
    before = {i: client.generate_ids(tenant_prefix(i) + user_turn(i, 2), key(i)).engine_id
              for i in range(NUM_TENANTS)}
    assert fleet.router is not None
    fleet.router.terminate()
    fleet.router.wait(15)
    fleet.start_router()
    with grpc.insecure_channel(fleet.router_address) as channel:
        fresh = RouterClient(channel)
        for i in range(NUM_TENANTS):
            again = fresh.generate_ids(tenant_prefix(i) + user_turn(i, 3), key(i))
            assert again.engine_id == before[i]
            assert again.num_cached_tokens >= len(tenant_prefix(i))
    client.channel.close()
    client.channel = grpc.insecure_channel(fleet.router_address)


def published_idle(redis_url: str) -> bool:
    """Every registered engine publishes no running or waiting request."""
    client = redis.Redis.from_url(redis_url)
    try:
        ids = [i.decode() for i in client.smembers(redis_schema.ENGINES_SET)]
        loads = [client.hmget(redis_schema.engine_key(i), "num_running", "num_waiting")
                 for i in ids]
        return bool(loads) and all(v == b"0" for load in loads for v in load)
    finally:
        client.close()


def test_two_router_replicas_agree_without_talking(fleet: Fleet, client: RouterClient) -> None:
    replica = fleet.add_router("router-replica", "prefix")
    with grpc.insecure_channel(replica.address) as channel:
        other = RouterClient(channel)
        for i in range(NUM_TENANTS):  # cached prefixes: the replica finds the same engine
            ours = client.generate_ids(tenant_prefix(i) + user_turn(i, 6), key(i))
            theirs = other.generate_ids(tenant_prefix(i) + user_turn(i, 7), key(i))
            assert theirs.engine_id == ours.engine_id
            assert theirs.num_cached_tokens >= len(tenant_prefix(i))

    async def decide_new_prefixes(selector: EngineSelector) -> list[str]:
        prompts = [tenant_prefix(200 + i) for i in range(16)]
        return [(await selector.decide(p, "tenant-0")).ranking[0].engine_id for p in prompts]

    async def two_replicas() -> tuple[list[str], list[str]]:
        indexes = [PrefixIndex(fleet.redis_url) for _ in range(2)]
        try:
            config = RoutingConfig(prefix=PrefixPolicyConfig(tie_rel=TIE_TOLERANCE))
            first, second = (EngineSelector(config, i, EnginePool()) for i in indexes)
            return await decide_new_prefixes(first), await decide_new_prefixes(second)
        finally:
            for index in indexes:
                await index.close()

    # New prefixes (no engine holds them): independent replicas still pick the same engine.
    # Among tied engines the one running fewer requests wins before the hash: wait until
    # the engines have published the requests above as done, so both replicas read alike.
    wait_until(lambda: published_idle(fleet.redis_url), 10,
               what="engines publishing no running request")
    first, second = asyncio.run(two_replicas())
    assert first == second
    assert set(first) == {"engine-0", "engine-1"}


def test_a_cancelled_stream_frees_its_blocks(fleet: Fleet, client: RouterClient) -> None:
    params = greedy(max_tokens=400, ignore_eos=True)
    stream = client.stream(build_request(prompt_token_ids=tenant_prefix(50), params=params),
                           key(1))
    first = next(stream)
    assert first.token_ids
    stream.cancel()  # type: ignore[attr-defined]
    addresses = [engine.address for engine in fleet.engines]

    def all_idle() -> bool:
        loads = [engine_load(a) for a in addresses]
        return all(x.num_running == 0 and x.kv_blocks_free == x.kv_blocks_total for x in loads)

    wait_until(all_idle, 5, what="engines to free the cancelled request's blocks")


def test_stop_strings_end_the_stream(client: RouterClient) -> None:
    full = client.generate(build_request(LONG_TEXT, params=greedy(max_tokens=12)), key(2))
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = client.generate(
        build_request(LONG_TEXT, params=greedy(max_tokens=12, stop=[stop])), key(2))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_stop_token_ends_the_stream_without_its_text(client: RouterClient) -> None:
    request = build_request(LONG_TEXT, params=greedy(max_tokens=12, ignore_eos=True))
    responses = list(client.stream(request, key(2)))
    ids = [t for r in responses for t in r.token_ids]
    pieces = [r.text_delta for r in responses]
    stop = ids[5]
    first = ids.index(stop)
    stopped = list(client.stream(
        build_request(LONG_TEXT, params=greedy(max_tokens=12, ignore_eos=True,
                                               stop_token_ids=[stop])), key(2)))
    assert [t for r in stopped for t in r.token_ids] == ids[: first + 1]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason.token_id == stop
    # vLLM: the stop token is not part of the text (each delta here is one token's text).
    assert "".join(r.text_delta for r in stopped) == "".join(pieces[:first])


def test_n2_streams_two_indexed_samples_from_one_engine(client: RouterClient) -> None:
    params = common_pb2.SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=6,
                                       ignore_eos=True, logprobs=1)
    responses = list(client.stream(build_request(LONG_TEXT, params=params), key(3)))
    by_index: dict[int, list[int]] = {0: [], 1: []}
    finals = {}
    for response in responses:
        by_index[response.index].extend(response.token_ids)
        assert len(response.logprobs) == len(response.token_ids)
        if response.HasField("finish_reason"):
            finals[response.index] = response
    assert sorted(finals) == [0, 1]
    assert all(len(ids) == 6 for ids in by_index.values())
    assert by_index[0] != by_index[1]
    assert finals[0].engine_id == finals[1].engine_id
    assert all(f.usage.completion_tokens == 6 for f in finals.values())


def test_client_request_ids_come_back_and_may_repeat(client: RouterClient) -> None:
    params = greedy(max_tokens=30, ignore_eos=True)
    request = build_request(prompt_token_ids=tenant_prefix(4), params=params,
                            request_id="same-id")
    streams = [client.stream(request, key(4)) for _ in range(2)]
    firsts = [next(s) for s in streams]  # both live at once on the same engine
    assert [f.request_id for f in firsts] == ["same-id", "same-id"]
    assert all(list(s)[-1].finish_reason == "length" for s in streams)


@pytest.mark.parametrize(
    ("request_", "api_key", "code", "message"),
    [
        (RouterGenerateRequest(), "key-0", "INVALID_ARGUMENT", "input must be set"),
        (build_request(prompt_token_ids=[]), "key-0", "INVALID_ARGUMENT", "must not be empty"),
        (build_request(""), "key-0", "INVALID_ARGUMENT", "prompt must not be empty"),
        (build_request(prompt_token_ids=[5, 99999]), "key-0", "INVALID_ARGUMENT", "99999"),
        (build_request("hi", params=greedy(n=0)), "key-0", "INVALID_ARGUMENT", "n must be"),
        (build_request("hi", params=greedy(logprobs=21)), "key-0", "INVALID_ARGUMENT", "logprobs"),
        (build_request("hi", params=greedy(presence_penalty=3)), "key-0", "INVALID_ARGUMENT",
         "presence_penalty"),
        (build_request("hi", params=greedy(top_p=0)), "key-0", "INVALID_ARGUMENT", "top_p"),
        (build_request("hi", params=greedy(stop=[""])), "key-0", "INVALID_ARGUMENT", "stop[0]"),
        (build_request(messages=[("robot", "x")]), "key-0", "INVALID_ARGUMENT", "role"),
        (build_request("hi"), "wrong-key", "UNAUTHENTICATED", "invalid API key"),
        (build_request("hi"), None, "UNAUTHENTICATED", "missing API key"),
    ],
)
def test_malformed_requests_are_rejected_and_service_goes_on(
    client: RouterClient,
    request_: RouterGenerateRequest,
    api_key: str | None,
    code: str,
    message: str,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.generate(request_, api_key)
    error: Any = info.value  # a grpc.Call as well as an RpcError
    assert error.code().name == code
    assert message in error.details()
    assert client.generate(build_request("hi", params=greedy(max_tokens=1)), key(3)).num_tokens


def test_requests_succeed_with_redis_stopped(fleet: Fleet, client: RouterClient) -> None:
    assert fleet.redis is not None
    fleet.redis.stop()
    try:
        served = {client.generate_ids(tenant_prefix(60 + i), key(i)).engine_id
                  for i in range(6)}
        assert served <= {"engine-0", "engine-1"}
    finally:
        fleet.redis.start()  # same port, empty: engines re-register within a heartbeat
    wait_until(lambda: len(redis.Redis.from_url(fleet.redis_url).smembers(
        redis_schema.ENGINES_SET)) == 2, 10, what="engines to re-register")


def test_a_killed_engines_traffic_goes_to_the_survivor(
    fleet: Fleet, client: RouterClient
) -> None:
    homes = {i: client.generate_ids(tenant_prefix(i) + user_turn(i, 4), key(i)).engine_id
             for i in range(NUM_TENANTS)}
    victim = next(e for e in fleet.engines if e.name == homes[0])
    victim.kill()
    victim.wait(10)
    started = time.monotonic()
    for i in range(NUM_TENANTS):
        done = client.generate_ids(tenant_prefix(i) + user_turn(i, 5), key(i))
        assert done.engine_id != victim.name
    assert time.monotonic() - started < 10
