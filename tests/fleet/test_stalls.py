"""Stalled engines seen from the router: real processes, SIGSTOP, real gRPC, HTTP and Redis.

A fleet (Redis, tokenizer, 2 engines, router with 2 s first-token and stream-stall
deadlines) where engines are frozen with SIGSTOP and thawed with SIGCONT:
- before the first token, the router gives up on the frozen engine after the deadline and
  the request completes on the other engine;
- after it, the gRPC stream ends with UNAVAILABLE naming the stall, the OpenAI SSE stream
  with an error chunk (503) then `data: [DONE]`; once thawed, the engine aborts the
  cancelled request and frees every KV block.
And in-process, against a real engine whose steps are slowed down: an engine that keeps
stepping is never cut off, even when its first token comes well after the deadline.

A frozen engine may have finished a short stream before SIGSTOP landed; streams are long
(400 tokens) and such an attempt is simply repeated, so no outcome depends on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.fleet import Fleet, ServiceProcess
from kvfleet.redis_server import RedisServer
from kvfleet.router_client import build_request
from kvfleet.v1 import router_pb2
from router.engines.dispatch import StreamDeadlines, open_engine_stream
from router.engines.pool import EnginePool
from router.routing.ranking import EngineView
from router.server import RouterConfig, parse_args
from tests.fixtures.engine_harness import EngineHarness, engine_options, gen_request, make_prompt
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import (
    RouterClient,
    engine_load,
    greedy,
    tenant_prefix,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 2.0
BLOCK_SIZE = 16
TENANT = "anonymous"  # no key file: every request is this tenant (the cache salt)
LONG = 400  # tokens: far more than the engine makes between a message and SIGSTOP


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 2,
        "engine_args": ("--num-kv-blocks", "256"),
        "router_args": ("--first-token-timeout", str(DEADLINE_S),
                        "--stream-stall-timeout", str(DEADLINE_S)),
        "metrics": True,
    }


@contextlib.contextmanager
def frozen(engines: Sequence[ServiceProcess]) -> Iterator[None]:
    for engine in engines:
        os.kill(engine.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for engine in engines:
            os.kill(engine.pid, signal.SIGCONT)


def wait_idle_and_registered(fleet: Fleet, redis_client: redis.Redis) -> None:
    """Every engine in the registry, nothing queued or running, every KV block free."""
    def ready() -> bool:
        for engine in fleet.engines:
            if not redis_client.exists(redis_schema.engine_key(engine.name)):
                return False
            load = engine_load(engine.address)
            if load.num_running or load.num_waiting or load.kv_blocks_free != load.kv_blocks_total:
                return False
        return True

    wait_until(ready, 30, what="engines registered, idle, every KV block free")


def aborted(fleet: Fleet) -> int:
    """Requests the engines finished as aborted (their Prometheus counters, summed)."""
    total = 0.0
    for engine in fleet.engines:
        url = f"http://127.0.0.1:{engine.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("kvfleet:request_success_total{") and \
                        'finished_reason="abort"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return int(total)


def router_retries(fleet: Fleet) -> dict[str, float]:
    """The router's kvfleet:router_retries counter by reason."""
    assert fleet.router is not None
    url = f"http://127.0.0.1:{fleet.router.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {
        line.split('reason="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines if line.startswith("kvfleet:router_retries_total{")
    }


def rest_of(stream: Iterator[router_pb2.RouterGenerateResponse]) -> Any:
    """Reads the stream to its end: the RpcError it ended with, or None if it finished."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as error:
        return error
    return None


def test_a_stall_before_the_first_token_moves_the_request_to_another_engine(
    fleet: Fleet, client: RouterClient, redis_client: redis.Redis
) -> None:
    wait_idle_and_registered(fleet, redis_client)
    prompt = tenant_prefix(70)
    home = client.generate_ids(prompt, None, greedy(1)).engine_id
    hashes = hash_token_blocks(prompt[:-1], BLOCK_SIZE, cache_salt=TENANT)
    epoch = redis_client.hget(redis_schema.engine_key(home), "epoch")
    assert isinstance(epoch, bytes)
    blocks = redis_schema.blocks_key(home, epoch.decode())
    wait_until(lambda: all(redis_client.smismember(blocks, hashes)), 10,
               what=f"{home} to publish the prompt's blocks")
    victim = next(e for e in fleet.engines if e.name == home)
    retries_before = router_retries(fleet).get("deadline_exceeded", 0.0)
    with frozen([victim]):  # the prefix lives only on the victim: it is ranked first
        started = time.monotonic()
        done = client.generate_ids(prompt + [5, 6, 7], None, greedy(4))
        elapsed = time.monotonic() - started
    assert done.engine_id != home and done.num_tokens == 4
    assert elapsed < DEADLINE_S + 15
    expected = f"{home}: stalled, no progress for {DEADLINE_S:g}s before the first token"
    assert expected in (fleet.log_dir / "router.log").read_text()
    assert router_retries(fleet).get("deadline_exceeded", 0.0) == retries_before + 1
    wait_idle_and_registered(fleet, redis_client)  # the thawed engine dropped the request


def test_a_stall_mid_stream_ends_it_with_unavailable_and_the_engine_frees_its_blocks(
    fleet: Fleet, client: RouterClient, redis_client: redis.Redis
) -> None:
    wait_idle_and_registered(fleet, redis_client)
    aborted_before = aborted(fleet)
    error = None
    for attempt in range(3):
        request = build_request(prompt_token_ids=tenant_prefix(80 + attempt),
                                params=greedy(LONG, ignore_eos=True))
        stream = client.stream(request)
        assert next(stream).token_ids
        with frozen(fleet.engines):
            started = time.monotonic()
            error = rest_of(stream)
            elapsed = time.monotonic() - started
        if error is not None:
            break
    assert error is not None, "every stream finished before its engine was frozen"
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "stalled: no progress for 2s (--stream-stall-timeout)" in error.details()
    assert elapsed < DEADLINE_S + 15
    wait_idle_and_registered(fleet, redis_client)
    wait_until(lambda: aborted(fleet) > aborted_before, 30,
               what="the thawed engine to abort the cancelled request")


def test_a_stall_mid_sse_stream_sends_an_error_chunk_then_done(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    wait_idle_and_registered(fleet, redis_client)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    events: list[str] = []
    for _ in range(3):
        request = urllib.request.Request(f"{fleet.http_url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            first = response.readline().decode()
            assert first.startswith("data: {")
            with frozen(fleet.engines):
                events = [line.decode().strip() for line in response]
        events = [e for e in events if e]
        if any('"error"' in e for e in events):
            break
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "stalled: no progress for 2s" in error["message"]
    wait_idle_and_registered(fleet, redis_client)


def test_a_slow_but_progressing_engine_is_not_cut_off(
    tiny_model_dir: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 16-token prefill chunks at >= 0.3 s a step: a 200-token prompt takes 13 steps, so its
    # first token comes after >= 3.9 s, twice the deadline, while the engine keeps stepping.
    options = engine_options(tiny_model_dir, redis_server.url, "slow", max_num_batched_tokens=16)
    harness = EngineHarness(options).start()
    try:
        engine = harness.server.async_engine.engine
        real_step = engine.step

        def slow_step() -> Any:
            time.sleep(0.3)
            return real_step()

        monkeypatch.setattr(engine, "step", slow_step)
        request = gen_request("slow-1", make_prompt(9, 200), 3)
        ttft, tokens, finish = asyncio.run(_stream(harness.address, request))
    finally:
        harness.stop()
    assert ttft > DEADLINE_S
    assert len(tokens) == 3 and finish == "length"


async def _stream(address: str, request: Any) -> tuple[float, list[int], str]:
    pool = EnginePool()
    deadlines = StreamDeadlines(first_token_s=DEADLINE_S, stall_s=DEADLINE_S)
    try:
        started = time.monotonic()
        stream = await open_engine_stream([EngineView("slow", address)], pool, request, 1,
                                          deadlines)
        ttft = time.monotonic() - started
        tokens: list[int] = []
        try:
            while (message := await stream.read()) is not None:
                tokens.extend(message.token_ids)
                if message.HasField("finish_reason"):
                    return ttft, tokens, message.finish_reason
        finally:
            stream.close()
        return ttft, tokens, ""
    finally:
        await pool.close()


@pytest.mark.parametrize(
    ("first_token_s", "stall_s", "keepalive_s"),
    [(30.0, 60.0, 5.0), (2.0, 2.0, 0.5), (0.0, 1.0, 0.25), (0.0, 0.0, None)],
)
def test_deadlines_ask_engines_for_keepalives_four_times_per_deadline(
    first_token_s: float, stall_s: float, keepalive_s: float | None
) -> None:
    assert StreamDeadlines(first_token_s, stall_s).keepalive_s == keepalive_s


def test_router_flags_set_the_deadlines() -> None:
    args = parse_args(["--tokenizer", "t:1", "--first-token-timeout", "7.5",
                       "--stream-stall-timeout", "0"])
    assert RouterConfig.from_args(args).deadlines == StreamDeadlines(7.5, 0.0)
    assert RouterConfig.from_args(parse_args(["--tokenizer", "t:1"])).deadlines == \
        StreamDeadlines(30.0, 60.0)
    for bad in ["-1", "nan", "inf", "soon"]:
        with pytest.raises(SystemExit):
            parse_args(["--tokenizer", "t:1", "--first-token-timeout", bad])
