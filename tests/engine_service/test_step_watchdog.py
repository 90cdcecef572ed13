"""The engine's step watchdog and keep-alives: a real engine server (gRPC, Redis, tiny model).

Stalls are injected in-process (a SIGSTOPped process could not answer health checks): the
engine's `step` is replaced on the instance by one that blocks on an Event, or sleeps to
make a slow-but-progressing engine; the engine thread is killed by making
`has_unfinished_requests` raise, outside every per-request guard of the loop.

Covers: a wedged step turns health NOT_SERVING and new requests UNAVAILABLE within the
watchdog timeout, keeps streams silent (no keep-alives), and health returns to SERVING once
the step returns; a dead engine thread fails its streams with UNAVAILABLE, reports
NOT_SERVING for good, refuses new requests and leaves Redis; keep-alives come only when asked
for (a bad interval is INVALID_ARGUMENT) and only while the loop advances; the watchdog's
judgement itself (`assess`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.service.async_engine import StepProgress
from engine.service.step_watchdog import assess
from kvfleet.contracts import keepalive, redis_schema
from kvfleet.redis_server import RedisServer
from kvfleet.v1 import engine_pb2, engine_pb2_grpc
from tests.fixtures.engine_harness import (
    EngineHarness,
    engine_options,
    gen_request,
    make_prompt,
    run,
    tokens_of,
    wait_all_blocks_free,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 30.0
WATCHDOG_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def start_engine(tiny_model_dir: Path, redis_server: RedisServer) -> Iterator[Callable[..., Any]]:
    """Factory: an in-process engine with a 1 s watchdog; all are stopped at teardown."""
    started: list[EngineHarness] = []

    def start(engine_id: str, **engine_kwargs: object) -> EngineHarness:
        options = engine_options(tiny_model_dir, redis_server.url, engine_id, **engine_kwargs)
        options = dataclasses.replace(options, watchdog_timeout_s=WATCHDOG_S)
        harness = EngineHarness(options).start()
        started.append(harness)
        return harness

    yield start
    for harness in started:
        harness.stop()


@pytest.fixture
def channel_to() -> Iterator[Callable[[EngineHarness], grpc.Channel]]:
    channels: list[grpc.Channel] = []

    def open_channel(harness: EngineHarness) -> grpc.Channel:
        channels.append(grpc.insecure_channel(harness.address))
        return channels[-1]

    yield open_channel
    for channel in channels:
        channel.close()


def health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    status: int = stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status
    return status


class Reader:
    """Reads a Generate stream on a thread, so the test can look at what came so far."""

    def __init__(self, call: Iterator[engine_pb2.GenerateResponse]) -> None:
        self.messages: queue.Queue[engine_pb2.GenerateResponse] = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(call,), daemon=True).start()

    def _run(self, call: Iterator[engine_pb2.GenerateResponse]) -> None:
        try:
            for message in call:
                self.messages.put(message)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.done.set()

    def drain(self) -> list[engine_pb2.GenerateResponse]:
        out = []
        while not self.messages.empty():
            out.append(self.messages.get_nowait())
        return out


def wedge_next_step(harness: EngineHarness, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The engine's next step blocks until the returned Event is set (later steps are normal)."""
    engine = harness.server.async_engine.engine
    real_step = engine.step
    release = threading.Event()

    def wedged_step() -> Any:
        monkeypatch.setattr(engine, "step", real_step)
        release.wait(TIMEOUT_S * 2)  # bounded: a failing test must not hang the thread
        return real_step()

    monkeypatch.setattr(engine, "step", wedged_step)
    return release


def test_a_wedged_step_turns_health_not_serving_until_it_returns(
    start_engine: Callable[..., EngineHarness],
    channel_to: Callable[[EngineHarness], grpc.Channel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    harness = start_engine("wedged")
    channel = channel_to(harness)
    stub = engine_pb2_grpc.EngineStub(channel)
    assert health(channel) == SERVING
    release = wedge_next_step(harness, monkeypatch)
    try:
        call = stub.Generate(gen_request("w-1", make_prompt(1, 20), 5), timeout=TIMEOUT_S,
                             metadata=keepalive.metadata(0.1))
        reader = Reader(call)
        started = time.monotonic()
        wait_until(lambda: health(channel) == NOT_SERVING, 20, what="health NOT_SERVING")
        assert time.monotonic() - started >= WATCHDOG_S * 0.9
        with pytest.raises(grpc.RpcError) as info:
            run(stub, gen_request("w-2", make_prompt(2, 20), 2))
        error: Any = info.value
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "stalled" in error.details() and "--watchdog-timeout" in error.details()
        # The loop began one iteration (the one now stuck) since the stream started: at most
        # one keep-alive, then silence while nothing advances.
        during = reader.drain()
        assert len(during) <= 1 and all(keepalive.is_keepalive(m) for m in during)
    finally:
        release.set()
    wait_until(lambda: health(channel) == SERVING, 20, what="health SERVING again")
    assert reader.done.wait(TIMEOUT_S) and reader.error is None
    messages = during + reader.drain()
    assert len(tokens_of(messages)) == 5 and messages[-1].finish_reason == "length"
    assert tokens_of(run(stub, gen_request("w-3", make_prompt(3, 20), 2))) != []


def test_a_dead_engine_thread_fails_streams_and_reports_not_serving_for_good(
    start_engine: Callable[..., EngineHarness],
    channel_to: Callable[[EngineHarness], grpc.Channel],
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    harness = start_engine("doomed")
    channel = channel_to(harness)
    stub = engine_pb2_grpc.EngineStub(channel)
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    wait_until(lambda: client.exists(redis_schema.engine_key("doomed")), 10,
               what="registration")
    call = stub.Generate(gen_request("d-1", make_prompt(4, 20), 200), timeout=TIMEOUT_S)
    assert next(call).token_ids
    engine = harness.server.async_engine.engine

    def broken() -> bool:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine, "has_unfinished_requests", broken)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    error: Any = info.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine thread died: RuntimeError: injected failure" in error.details()
    wait_until(lambda: health(channel) == NOT_SERVING, 20, what="health NOT_SERVING")
    with pytest.raises(grpc.RpcError) as info:
        run(stub, gen_request("d-2", make_prompt(5, 20), 2))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as info:
        stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: not client.sismember(redis_schema.ENGINES_SET, "doomed"), 10,
               what="deregistration")
    assert not client.exists(redis_schema.engine_key("doomed"))
    monkeypatch.undo()  # even a working engine object cannot revive the dead loop
    time.sleep(WATCHDOG_S)  # a few watchdog rounds: it must not flip back
    assert health(channel) == NOT_SERVING
    client.close()


def test_keepalives_come_only_when_asked_and_while_the_loop_advances(
    start_engine: Callable[..., EngineHarness],
    channel_to: Callable[[EngineHarness], grpc.Channel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 16-token prefill chunks and 0.1 s per step: a 120-token prompt takes 8 steps, ~0.8 s
    # before its first token, during which the loop advances without tokens for it.
    harness = start_engine("slow", max_num_batched_tokens=16)
    stub = engine_pb2_grpc.EngineStub(channel_to(harness))
    engine = harness.server.async_engine.engine
    real_step = engine.step

    def slow_step() -> Any:
        time.sleep(0.1)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    prompt = make_prompt(6, 120)
    asked = list(stub.Generate(gen_request("k-1", prompt, 3), timeout=TIMEOUT_S,
                               metadata=keepalive.metadata(0.05)))
    plain = list(stub.Generate(gen_request("k-2", prompt[:-1] + [7], 3), timeout=TIMEOUT_S))
    first_token = next(i for i, m in enumerate(asked) if m.token_ids)
    assert first_token >= 1 and all(keepalive.is_keepalive(m) for m in asked[:first_token])
    assert {m.engine_id for m in asked} == {"slow"}
    assert tokens_of(asked) == tokens_of(run(stub, gen_request("k-3", prompt, 3)))
    assert not any(keepalive.is_keepalive(m) for m in plain) and len(plain) == 3
    for value in ["0", "-1", "nan", "soon"]:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(gen_request("k-4", prompt, 1), timeout=TIMEOUT_S,
                               metadata=((keepalive.METADATA_KEY, value),)))
        error: Any = info.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert keepalive.METADATA_KEY in error.details() and repr(value) in error.details()
    wait_all_blocks_free(stub)


@pytest.mark.parametrize(
    ("progress", "now", "timeout_s", "verdict"),
    [
        (StepProgress(5, at=100.0, idle=True), 1000.0, 1.0, None),  # idle: never stalled
        (StepProgress(5, at=100.0, idle=False), 100.9, 1.0, None),
        (StepProgress(5, at=100.0, idle=False), 101.5, 1.0, "not advanced for 1.5s"),
        (StepProgress(5, at=100.0, idle=False), 1000.0, 0.0, None),  # 0: stall check off
        (StepProgress(5, 100.0, True, failure="engine thread died: X"), 100.0, 0.0,
         "engine thread died: X"),
    ],
)
def test_assess(progress: StepProgress, now: float, timeout_s: float,
                verdict: str | None) -> None:
    problem = assess(progress, now, timeout_s)
    if verdict is None:
        assert problem is None
    else:
        assert problem is not None and verdict in problem
