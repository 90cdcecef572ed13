"""Forwarding to engines: try the ranking in order until one starts streaming.

Role: `open_engine_stream` sends the request to the best engine; if that engine fails before
its first message (refused connection, killed process, queue full, shutting down) the next
engine in the ranking gets the same request. Once a message has arrived the request is
committed to that engine: text may already be on its way to the client, so a later failure
is relayed as an error, never replayed elsewhere.

Invariants:
- Only failures that say nothing about the request itself are retried; INVALID_ARGUMENT
  (and any other code) goes straight back to the client. When no engine takes it, the
  client gets RESOURCE_EXHAUSTED if every engine said it was full, else UNAVAILABLE.
- An engine that failed with a transport-level code becomes a suspect in the pool, so the
  next decisions avoid it until its registry entry expires or it comes back elsewhere.
- While an attempt or a stream is open it counts as in flight on its engine (the pool's
  fresher-than-Redis load signal); `EngineStream.close` always ends that count and cancels
  the call, which makes the engine abort the request and free its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
import grpc.aio

from kvfleet.errors import OverloadedError, UnavailableError
from kvfleet.tracing import trace_metadata
from kvfleet.v1 import engine_pb2
from router.engine_pool import EnginePool
from router.policy import EngineView

logger = logging.getLogger(__name__)

RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
    }
)
# Codes that suggest the engine itself is gone, not merely busy.
SUSPECT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}
)
# How long an aborted request's engine stream may take to send its final message.
ABORT_DRAIN_S = 2.0


class EngineStream:
    """An engine's Generate stream that has produced its first message."""

    def __init__(
        self,
        engine: EngineView,
        call: grpc.aio.UnaryStreamCall,
        first: engine_pb2.GenerateResponse,
        pool: EnginePool,
    ) -> None:
        self.engine = engine
        self._call = call
        self._pending: engine_pb2.GenerateResponse | None = first
        self._pool = pool
        self._closed = False

    async def read(self) -> engine_pb2.GenerateResponse | None:
        """The next message; None once the stream has ended."""
        if self._pending is not None:
            message, self._pending = self._pending, None
            return message
        message = await self._call.read()
        if message is grpc.aio.EOF:
            return None
        assert isinstance(message, engine_pb2.GenerateResponse)
        return message

    async def abort(self, request_id: str) -> engine_pb2.GenerateResponse | None:
        """Abort the request (stop string hit); returns the engine's final message if it came."""
        stub = self._pool.stub(self.engine.engine_id, self.engine.address)
        try:
            await stub.Abort(
                engine_pb2.AbortRequest(request_id=request_id),
                timeout=ABORT_DRAIN_S,
                metadata=trace_metadata(),
            )
            return await asyncio.wait_for(self._last_message(), ABORT_DRAIN_S)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            logger.debug("abort of %s on %s: %s", request_id, self.engine.engine_id, e)
            return None
        finally:
            self.close()

    async def _last_message(self) -> engine_pb2.GenerateResponse | None:
        last = None
        while (message := await self.read()) is not None:
            last = message
        return last

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._call.cancel()  # no-op when finished; otherwise the engine frees the request
            self._pool.end(self.engine.engine_id)


async def open_engine_stream(
    ranking: Sequence[EngineView],
    pool: EnginePool,
    request: engine_pb2.GenerateRequest,
    max_attempts: int,
) -> EngineStream:
    """Start `request` on the first engine of `ranking` that answers.

    OverloadedError when every engine tried said its queue is full, else UnavailableError.
    """
    failures: list[tuple[grpc.StatusCode, str]] = []
    for engine in ranking[:max_attempts]:
        stream = await _attempt(engine, pool, request, failures)
        if stream is not None:
            return stream
    summary = "; ".join(text for _, text in failures)
    if failures and all(code is grpc.StatusCode.RESOURCE_EXHAUSTED for code, _ in failures):
        raise OverloadedError(f"every engine is at capacity: {summary}")
    raise UnavailableError(f"no engine could take the request: {summary}")


async def _attempt(
    engine: EngineView,
    pool: EnginePool,
    request: engine_pb2.GenerateRequest,
    failures: list[tuple[grpc.StatusCode, str]],
) -> EngineStream | None:
    call = pool.stub(engine.engine_id, engine.address).Generate(
        request, metadata=trace_metadata()
    )
    pool.begin(engine.engine_id)
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as e:
        pool.end(engine.engine_id)
        if e.code() not in RETRYABLE_CODES:
            raise
        if e.code() in SUSPECT_CODES:
            pool.mark_suspect(engine.engine_id, engine.address)
        failures.append((e.code(), f"{engine.engine_id}: {e.code().name} {e.details()}"))
        return None
    except BaseException:  # cancelled by the client: the engine must drop the request
        call.cancel()
        pool.end(engine.engine_id)
        raise
    if first is grpc.aio.EOF:
        pool.end(engine.engine_id)
        failures.append(
            (grpc.StatusCode.UNAVAILABLE, f"{engine.engine_id}: stream ended without a message")
        )
        return None
    return EngineStream(engine, call, first, pool)
