"""`EngineThread` and its use by the engine server: jobs run in order on one daemon thread,
a job's failure reaches only its future, the final job ends the thread; and a served engine
is built (model load, GEMM backend measurement) on the very thread that runs its steps, so
the process holds one OpenMP pool (engine.service.engine_thread says why that matters).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import engine.service.server as server_module
from engine.core.llm_engine import LLMEngine
from engine.service.engine_thread import EngineThread
from kvfleet.redis_server import RedisServer
from kvfleet.v1 import engine_pb2_grpc
from tests.fixtures.engine_harness import (
    EngineHarness,
    engine_options,
    gen_request,
    make_prompt,
    run,
    tokens_of,
)

TIMEOUT_S = 30


def test_jobs_run_in_order_on_one_thread() -> None:
    thread = EngineThread(name="test-engine-thread")
    seen: list[tuple[int, int]] = []
    futures = [thread.submit(lambda i=i: seen.append((i, threading.get_ident())))
               for i in range(5)]
    for future in futures:
        future.result(TIMEOUT_S)
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert {ident for _, ident in seen} == {thread.thread.ident}
    assert thread.thread.daemon
    thread.close()
    thread.thread.join(TIMEOUT_S)
    assert not thread.thread.is_alive()


def test_a_failing_job_fails_its_future_only() -> None:
    thread = EngineThread()

    def boom() -> None:
        raise ValueError("bad adapter")

    failed = thread.submit(boom)
    after = thread.submit(lambda: 42)
    with pytest.raises(ValueError, match="bad adapter"):
        failed.result(TIMEOUT_S)
    assert after.result(TIMEOUT_S) == 42
    thread.close()


def test_the_last_job_ends_the_thread_and_later_submissions_fail() -> None:
    thread = EngineThread()
    release = threading.Event()
    last = thread.run_last(lambda: release.wait(TIMEOUT_S))
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(lambda: None)
    release.set()
    assert last.result(TIMEOUT_S) is True
    thread.thread.join(TIMEOUT_S)
    assert not thread.thread.is_alive()


@pytest.fixture
def build_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The thread idents LLMEngine was constructed on by the engine server."""
    idents: list[int] = []

    def recording(*args: Any, **kwargs: Any) -> LLMEngine:
        idents.append(threading.get_ident())
        return LLMEngine(*args, **kwargs)

    monkeypatch.setattr(server_module, "LLMEngine", recording)
    yield idents


def test_server_builds_the_engine_on_the_thread_that_steps_it(
    tiny_model_dir: Path, redis_server: RedisServer, build_threads: list[int]
) -> None:
    harness = EngineHarness(
        engine_options(tiny_model_dir, redis_server.url, "one-thread")
    ).start()
    try:
        step_threads: set[int] = set()
        harness.server.async_engine.add_step_listener(
            lambda _events: step_threads.add(threading.get_ident())
        )
        with grpc.insecure_channel(harness.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            responses = run(stub, gen_request("one-thread-1", make_prompt(3, 20), 4))
        assert len(tokens_of(responses)) == 4
        assert len(build_threads) == 1
        assert step_threads == {build_threads[0]}
        assert build_threads[0] != threading.get_ident()
    finally:
        harness.stop()
