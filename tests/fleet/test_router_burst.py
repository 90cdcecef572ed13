"""A burst of 500 concurrent requests on a real 2-engine fleet: all served, all routed by prefix.

Redis, tokenizer, two engines (tiny model) and the router run as processes. Eight tenant
prefixes are first made resident, each on the engine the router chose for it; then 500
requests of those prefixes arrive at once. Every one must succeed on its prefix's engine,
served from its cache, and the router's own metrics must show that every decision used the
prefix index (policy `prefix`, no Redis error, no pool timeout) and that no engine was
taken for failed.

The router charges recomputing a prefix another engine holds 1000 times its compute time
(`--duplicate-weight`), so the cost model never moves a prefix off its engine: any request
off its prefix's engine then means a decision made without the index (spilling itself is
tested in tests/router/test_ttft_routing.py).
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import grpc.aio
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.fleet import Fleet
from kvfleet.router_client import auth_metadata, build_request
from kvfleet.v1 import router_pb2, router_pb2_grpc
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import (
    API_KEYS,
    NUM_TENANTS,
    RouterClient,
    greedy,
    tenant_prefix,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

NUM_REQUESTS = 500
BLOCK_SIZE = 16
PREFIX_TOKENS = 96  # 6 full blocks: what every burst request finds cached
BURST_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 2,
        "api_keys": True,
        "router_args": ("--duplicate-weight", "1000"),
        "engine_threads": 1,
        "metrics": True,
    }


def tenant_key(index: int) -> str:
    return API_KEYS[f"tenant-{index}"]


def suffix(number: int) -> list[int]:
    """8 tokens unique to one request (the partial last block: never shared)."""
    return [3 + (number * 13 + j * 7) % 500 for j in range(8)]


def router_metrics(fleet: Fleet) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert fleet.router is not None
    url = f"http://127.0.0.1:{fleet.router.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
                 **labels: str) -> float:
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and labels.items() <= dict(sample_labels).items())


def make_prefixes_resident(fleet: Fleet) -> dict[int, str]:
    """One request per tenant prefix; returns tenant -> engine id once Redis shows the blocks."""
    homes = {}
    store = redis.Redis.from_url(fleet.redis_url)
    try:
        with grpc.insecure_channel(fleet.router_address) as channel:
            client = RouterClient(channel)
            for tenant in range(NUM_TENANTS):
                ids = tenant_prefix(tenant, PREFIX_TOKENS) + suffix(10_000 + tenant)
                homes[tenant] = client.generate_ids(ids, tenant_key(tenant)).engine_id
        for tenant, engine in homes.items():
            hashes = hash_token_blocks(tenant_prefix(tenant, PREFIX_TOKENS), BLOCK_SIZE,
                                       cache_salt=f"tenant-{tenant}")

            def published(engine: str = engine, hashes: list[bytes] = hashes) -> bool:
                epoch = store.hget(redis_schema.engine_key(engine), "epoch")
                if not isinstance(epoch, bytes):
                    return False
                key = redis_schema.blocks_key(engine, epoch.decode())
                return all(store.smismember(key, hashes))

            wait_until(published, 10, what=f"tenant-{tenant}'s prefix in Redis")
    finally:
        store.close()
    return homes


async def burst(address: str) -> list[tuple[int, str, int] | BaseException]:
    """NUM_REQUESTS generations at once; per request (tenant, engine id, cached) or the error."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one(number: int) -> tuple[int, str, int]:
            tenant = number % NUM_TENANTS
            request = build_request(
                prompt_token_ids=tenant_prefix(tenant, PREFIX_TOKENS) + suffix(number),
                params=greedy(max_tokens=2),
            )
            final: router_pb2.RouterGenerateResponse | None = None
            call = stub.Generate(request, metadata=auth_metadata(tenant_key(tenant)),
                                 timeout=BURST_TIMEOUT_S)
            async for response in call:
                if response.HasField("finish_reason"):
                    final = response
            assert final is not None, f"request {number} ended without a final message"
            return tenant, final.engine_id, final.num_cached_tokens

        return await asyncio.gather(*(one(n) for n in range(NUM_REQUESTS)),
                                    return_exceptions=True)


def test_a_burst_is_served_and_routed_by_prefix(fleet: Fleet) -> None:
    homes = make_prefixes_resident(fleet)
    before = router_metrics(fleet)

    results = asyncio.run(burst(fleet.router_address))

    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {NUM_REQUESTS} failed, e.g. {errors[:3]}"
    served = [r for r in results if not isinstance(r, BaseException)]
    misrouted = [(t, e) for t, e, _ in served if e != homes[t]]
    assert not misrouted, f"{len(misrouted)} requests left their prefix's engine: {misrouted[:5]}"
    assert all(cached == PREFIX_TOKENS for _, _, cached in served)

    after = router_metrics(fleet)
    decisions = "kvfleet:router_routing_decisions_total"
    assert metric_total(after, decisions) - metric_total(before, decisions) == NUM_REQUESTS
    assert (metric_total(after, decisions, policy="prefix")
            - metric_total(before, decisions, policy="prefix")) == NUM_REQUESTS
    assert metric_total(after, "kvfleet:router_redis_errors_total") == 0
    assert metric_total(after, "kvfleet:router_redis_pool_timeouts_total") == 0
    assert fleet.router is not None
    assert "failed; avoiding it" not in fleet.router.log_tail(1_000_000)
