"""A 1 prefill + 1 decode fleet (real processes, tiny model): long prompts go through the
prefill engine and continue on the decode engine, short ones go straight to the decode
engine; greedy text equals transformers'; the KV goes through shared memory (both engines
on this host, `--kv-transfer auto`); every block ends free on both; a dead prefill engine
leaves the decode engine serving whole requests."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from kvfleet.contracts import redis_schema
from kvfleet.fleet import Fleet
from kvfleet.router_client import build_request
from tests.fixtures.fleets import FleetOptions, running_fleet
from tests.fixtures.greedy import transformers_greedy
from tests.fixtures.router_fleet import API_KEYS, RouterClient, engine_load, greedy, wait_until

pytestmark = pytest.mark.timeout(240)
KEY = API_KEYS["tenant-0"]
LONG = [(7 * i + 3) % 500 + 3 for i in range(70)]
SHORT = LONG[:10]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    options: FleetOptions = {
        "prefill_engines": 1, "decode_engines": 1, "api_keys": True,
        "router_args": ("--disagg-prefill-threshold", "32"),
    }
    with running_fleet(tiny_model_dir, tmp_path_factory.mktemp("fleet"), **options) as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> Iterator[RouterClient]:
    with grpc.insecure_channel(fleet.router_address) as channel:
        yield RouterClient(channel)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    return transformers_greedy(tiny_model_dir, [LONG, SHORT], 8)


def _ids(client: RouterClient, prompt: list[int]) -> tuple[list[int], str, int]:
    ids: list[int] = []
    engine, cached = "", 0
    for response in client.stream(build_request(
        prompt_token_ids=prompt, params=greedy(8, ignore_eos=True)), KEY):
        ids.extend(response.token_ids)
        if response.HasField("finish_reason"):
            engine, cached = response.engine_id, response.num_cached_tokens
    return ids, engine, cached


def _all_free(fleet: Fleet) -> None:
    for engine in fleet.engines:
        def idle(address: str = engine.address) -> bool:
            load = engine_load(address)
            return load.kv_blocks_free == load.kv_blocks_total and load.num_running == 0
        assert wait_until(idle)


def _wait_published(fleet: Fleet, engine_id: str, blocks: int) -> None:
    """Until Redis shows `engine_id` caching `blocks` blocks: the router learns which blocks a
    decode engine holds (and so which a transfer may skip) only from what it published."""
    client = redis.Redis.from_url(fleet.redis_url, socket_timeout=5)
    try:
        def held() -> bool:
            keys = client.scan_iter(match=redis_schema.blocks_key_pattern(engine_id))
            return sum(client.scard(key) for key in keys) >= blocks
        assert wait_until(held)
    finally:
        client.close()


def test_long_prompt_is_prefilled_then_decoded_exactly(fleet, client, reference):
    ids, engine, _ = _ids(client, LONG)
    assert ids == reference[0]
    assert engine == "engine-1"  # the decode engine finished it
    _wait_published(fleet, "engine-1", len(LONG) // 16)
    ids, _, cached = _ids(client, LONG)  # again: the prefill engine's prefix cache hits
    assert ids == reference[0]
    assert cached == 64
    _all_free(fleet)
    # Same host: shared memory. 5 blocks, then only the partial one (the decode engine
    # caches the 4 full blocks since the first time).
    assert _blocks_sent(fleet) == {"shm": 5.0 + 1.0}


def _blocks_sent(fleet: Fleet) -> dict[str, float]:
    """The prefill engine's kvfleet:kv_transfer_blocks_total by transport."""
    port = fleet.engines[0].metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        lines = page.read().decode().splitlines()
    sent: dict[str, float] = {}
    for line in lines:
        if line.startswith("kvfleet:kv_transfer_blocks_total{"):
            transport = line.split('transport="', 1)[1].split('"', 1)[0]
            sent[transport] = float(line.rsplit(" ", 1)[1])
    return sent


def test_short_prompt_goes_straight_to_decode(fleet, client, reference):
    ids, engine, _ = _ids(client, SHORT)
    assert ids == reference[1]
    assert engine == "engine-1"
    _all_free(fleet)


def test_decode_engine_dying_after_handoff_fails_clearly_and_prefill_frees(fleet, client):
    """The request is committed once its first token went out: a clear UNAVAILABLE, and the
    prefill engine holds nothing of it."""
    stream = client.stream(build_request(prompt_token_ids=LONG[::-1],
                                         params=greedy(200, ignore_eos=True)), KEY)
    with pytest.raises(grpc.RpcError) as info:
        for response in stream:
            if response.token_ids:
                fleet.engines[1].kill()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    load = engine_load(fleet.engines[0].address)
    assert wait_until(lambda: engine_load(fleet.engines[0].address).kv_blocks_free
                      == load.kv_blocks_total)
    fleet.engines[1].wait(10)
    fleet.engines[1] = fleet.start_engine_process(1)
    fleet.wait_ready([fleet.engines[1]])


def test_dead_prefill_engine_falls_back_to_decode(fleet, client, reference):
    fleet.engines[0].kill()
    ids, engine, _ = _ids(client, LONG)
    assert ids == reference[0]
    assert engine == "engine-1"
    load = engine_load(fleet.engines[1].address)
    assert wait_until(lambda: engine_load(fleet.engines[1].address).kv_blocks_free
                      == load.kv_blocks_total)
