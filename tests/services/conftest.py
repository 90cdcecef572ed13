"""Fixtures for service tests: real gRPC servers on loopback, no mocks.

`ThreadedServer` runs a `kvfleet.runtime.grpc_server.GrpcServer` on its own event-loop thread, so
tests stay plain synchronous functions that talk to it with the generated sync stubs over a
real channel (pytest-asyncio is not needed). Every client call in these tests passes a
timeout so a regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from kvfleet.redis_server import RedisServer
from kvfleet.runtime.grpc_server import GrpcServer
from tokenizer_svc.server import build_server

T = TypeVar("T")
# Seconds any single client call or server start may take before the test fails.
CALL_TIMEOUT_S = 30.0


class ThreadedServer:
    """A GrpcServer started on a private event loop in a daemon thread."""

    def __init__(self, build: Callable[[], GrpcServer]) -> None:
        self._build = build
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="grpc-server", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: GrpcServer | None = None
        self._stop: asyncio.Event | None = None

    def start(self) -> ThreadedServer:
        self._thread.start()
        if not self._ready.wait(CALL_TIMEOUT_S):
            raise TimeoutError("server did not start")
        if self._error is not None:
            raise self._error
        return self

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    def submit(self, make: Callable[[], Awaitable[T]]) -> Future[T]:
        """Run `make()` on the server's loop; returns a concurrent Future."""
        assert self.loop is not None

        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        return self.submit(make).result(CALL_TIMEOUT_S)

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(CALL_TIMEOUT_S)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced to start() if it failed before ready
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.server = self._build()
        await self.server.start()
        self._ready.set()
        await self._stop.wait()
        await self.server.shutdown()


@pytest.fixture
def threaded_server() -> Iterator[Callable[[Callable[[], GrpcServer]], ThreadedServer]]:
    """Factory: start a server built by the given function; all are stopped at teardown."""
    started: list[ThreadedServer] = []

    def start(build: Callable[[], GrpcServer]) -> ThreadedServer:
        server = ThreadedServer(build).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _tokenizer_server(model_dir: Path) -> Iterator[ThreadedServer]:
    server = ThreadedServer(lambda: build_server(model_dir, "127.0.0.1", 0)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_tokenizer_server(tiny_model_dir: Path) -> Iterator[ThreadedServer]:
    yield from _tokenizer_server(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_channel(tiny_tokenizer_server: ThreadedServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(tiny_tokenizer_server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def smollm2_tokenizer_server(smollm2_dir: Path) -> Iterator[ThreadedServer]:
    yield from _tokenizer_server(smollm2_dir)


@pytest.fixture(scope="module")
def smollm2_channel(smollm2_tokenizer_server: ThreadedServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(smollm2_tokenizer_server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free port, one per test module (no fakes)."""
    with RedisServer() as server:
        yield server
