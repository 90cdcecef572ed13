"""Test helpers for the engine service: an in-process `EngineServer` on its own event loop.

`EngineHarness` runs the real wiring (LLMEngine → AsyncEngine → gRPC + Redis publisher) on a
private event-loop thread, so tests stay synchronous and talk to it over a real loopback
channel with the generated stubs. `call()` runs a coroutine on the server's loop (for tests
of `AsyncEngine` itself). Every wait has a timeout so a regression fails instead of hanging.
Request helpers build greedy, EOS-ignoring requests so stream lengths are deterministic.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import redis

from engine.config import EngineConfig
from engine.service.server import EngineServer, EngineServerOptions
from kvfleet.contracts import redis_schema
from kvfleet.runtime.options import ServerOptions
from kvfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.services.polling import wait_until  # noqa: F401 - re-exported

T = TypeVar("T")
TIMEOUT_S = 30.0
# A client channel whose small, fixed HTTP/2 window stops the server from writing ahead, so a
# stream the test does not read stays in flight on the server.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def engine_options(
    model_dir: Path, redis_url: str, engine_id: str, **engine_kwargs: Any
) -> EngineServerOptions:
    """Options for a small CPU engine on 127.0.0.1, free port, short grace period."""
    config: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}
    config.update(engine_kwargs)
    return EngineServerOptions(
        engine=EngineConfig(model=str(model_dir), **config),
        engine_id=engine_id,
        redis_url=redis_url,
        server=ServerOptions(host="127.0.0.1", port=0, grace_s=5.0),
    )


class EngineHarness:
    """An EngineServer started on a private event loop in a daemon thread."""

    def __init__(self, options: EngineServerOptions) -> None:
        self.server = EngineServer(options)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._deregister = True
        self._thread = threading.Thread(target=self._run, name="engine-harness", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.port = 0

    def start(self) -> EngineHarness:
        self._thread.start()
        if not self._ready.wait(TIMEOUT_S):
            raise TimeoutError("engine server did not start")
        if self._error is not None:
            raise self._error
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, make: Callable[[], Awaitable[T]], timeout_s: float = TIMEOUT_S) -> T:
        """Run `make()` on the server's event loop and wait for its result."""
        assert self._loop is not None

        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    def in_engine_thread(self, fn: Callable[[], T]) -> T:
        return self.server.async_engine.call_in_engine_thread(fn).result(TIMEOUT_S)

    def stop(self, *, deregister: bool = True) -> None:
        """Graceful stop; deregister=False leaves the Redis keys behind like a crash."""
        self._deregister = deregister
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(TIMEOUT_S)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to start() if it failed before ready
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.port = await self.server.start()
        self._ready.set()
        await self._stop.wait()
        await self.server.shutdown(deregister=self._deregister)



def make_prompt(seed: int, length: int) -> list[int]:
    """A reproducible prompt of in-vocabulary, non-special ids."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def gen_request(
    request_id: str, prompt: list[int], max_tokens: int, **params: object
) -> engine_pb2.GenerateRequest:
    """A greedy request ignoring EOS (deterministic length); `params` override any field."""
    cache_salt = str(params.pop("cache_salt", ""))
    fields: dict[str, object] = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    fields.update(params)
    sampling = common_pb2.SamplingParams(**fields)  # type: ignore[arg-type]
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling,
        cache_salt=cache_salt,
    )


def run(
    stub: engine_pb2_grpc.EngineStub, request: engine_pb2.GenerateRequest
) -> list[engine_pb2.GenerateResponse]:
    """The whole stream of one Generate call."""
    return list(stub.Generate(request, timeout=TIMEOUT_S))


def tokens_of(responses: list[engine_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def blocks_of(client: redis.Redis, engine_id: str, epoch: str) -> set[bytes]:
    # decode_responses is off: members are the raw 16-byte digests.
    return cast(set[bytes], client.smembers(redis_schema.blocks_key(engine_id, epoch)))


def wait_all_blocks_free(stub: engine_pb2_grpc.EngineStub) -> engine_pb2.LoadInfo:
    """Poll GetLoad until no request is queued or running and every KV block is free."""
    def idle() -> engine_pb2.LoadInfo | None:
        load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)
        free = load.kv_blocks_free == load.kv_blocks_total
        return load if free and load.num_running == 0 and load.num_waiting == 0 else None

    load = wait_until(idle)
    assert load is not None
    return load


def generated_tokens(harness: EngineHarness) -> int:
    """Tokens the engine has sampled so far (read on the engine thread)."""
    engine = harness.server.async_engine.engine
    return int(harness.in_engine_thread(engine.get_stats)["generation_tokens"])
