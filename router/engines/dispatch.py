"""Forwarding to engines: try the ranking in order until one starts streaming.

Role: `open_engine_stream` sends the request to the best engine; if that engine fails before
its first token (refused connection, killed process, queue full, shutting down, stalled)
the next engine in the ranking gets the same request. Once a token has arrived the request
is committed to that engine: text may already be on its way to the client, so a later
failure is relayed as an error, never replayed elsewhere.

Stalls (`StreamDeadlines`): engines are asked for keep-alives (`kvfleet.contracts.keepalive`),
empty messages sent while they make progress without a token for this request (queued, long
chunked prefill, recompute after preemption). Both deadlines therefore measure *silence*,
and reset on every message, keep-alives included: a slow engine that keeps stepping is never
cut off, however long its time to first token; one that stops stepping (process stopped,
loop wedged) is. Before the first token, `--first-token-timeout` of silence makes the router
cancel the call and try the next engine; after it, `--stream-stall-timeout` of silence ends
the stream with UNAVAILABLE ("engine X stalled: no progress for N s") and cancels the call,
so the engine frees the request's blocks whenever it wakes up. A stalled engine becomes a
suspect. Silence a healthy engine can produce: one step plus one keep-alive interval (a
quarter of the shorter deadline, at most `MAX_KEEPALIVE_S`), so each deadline must exceed
the engine's longest step, as its `--watchdog-timeout` must.

Invariants:
- Keep-alives never leave this module: `EngineStream.read` returns token/final messages only.
- Only failures that say nothing about the request itself are retried; INVALID_ARGUMENT
  (and any other code) goes straight back to the client. When no engine takes it, the
  client gets RESOURCE_EXHAUSTED if every engine said it was full, else UNAVAILABLE.
- An engine that failed with a transport-level code becomes a suspect in the pool, so the
  next decisions avoid it until its registry entry expires or it comes back elsewhere.
- While an attempt or a stream is open it counts as in flight on its engine (the pool's
  fresher-than-Redis load signal), and until its first message as prefilling there with its
  uncached prompt tokens; `EngineStream.close` always ends that count and cancels the call,
  which makes the engine abort the request and free its blocks.
- With the decision's `PendingClaims`, each engine tried gets the prompt's blocks marked
  pending when the request is sent (a background write, `router.routing.pending`); an attempt
  that fails, however, releases them, so other routers stop sending that prefix there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from kvfleet.contracts import keepalive
from kvfleet.contracts.errors import OverloadedError, UnavailableError
from kvfleet.runtime.tracing import trace_metadata
from kvfleet.v1 import engine_pb2
from router.engines.pool import EnginePool
from router.routing.pending import PendingClaims
from router.routing.ranking import EngineView

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
# Silence allowed before the first token / between messages after it. A healthy engine is
# silent for at most one step (plus a keep-alive interval): a full 2048-token prefill chunk
# of a small model on a busy CPU takes seconds, a big model's tens of seconds. Retrying
# before the first token costs only latency, so that deadline is the shorter one; cutting
# a stream the client is already reading is worse than waiting, so that one is longer.
DEFAULT_FIRST_TOKEN_TIMEOUT_S = 30.0
DEFAULT_STREAM_STALL_TIMEOUT_S = 60.0
MAX_KEEPALIVE_S = 5.0


class EngineStalledError(UnavailableError):
    """An engine sent nothing, not even a keep-alive, for longer than the stall deadline."""


@dataclass(frozen=True)
class StreamDeadlines:
    """Seconds of engine silence tolerated before / after the first token (0: no limit)."""

    first_token_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S
    stall_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        for name, value in (("first_token_s", self.first_token_s), ("stall_s", self.stall_s)):
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value}")

    @property
    def keepalive_s(self) -> float | None:
        """The keep-alive interval to ask engines for: 4 per deadline (None: no deadline)."""
        limits = [t for t in (self.first_token_s, self.stall_s) if t > 0]
        return min(MAX_KEEPALIVE_S, min(limits) / 4) if limits else None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return trace_metadata() + keepalive.metadata(self.keepalive_s)


NO_DEADLINES = StreamDeadlines(0.0, 0.0)


async def _next_message(
    call: grpc.aio.UnaryStreamCall, on_keepalive: Callable[[], None] | None = None
) -> engine_pb2.GenerateResponse | None:
    """The next message that is not a keep-alive (`on_keepalive` is called for each one
    skipped); None at the end of the stream."""
    while True:
        message = await call.read()
        if message is grpc.aio.EOF:
            return None
        assert isinstance(message, engine_pb2.GenerateResponse)
        if not keepalive.is_keepalive(message):
            return message
        if on_keepalive is not None:
            on_keepalive()


async def _read(
    call: grpc.aio.UnaryStreamCall, timeout_s: float
) -> engine_pb2.GenerateResponse | None:
    """The next message that is not a keep-alive; None at the end of the stream.

    TimeoutError after `timeout_s` (if > 0) without any message (every keep-alive restarts
    the wait); the caller then cancels the call.
    """
    if timeout_s <= 0:
        return await _next_message(call)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout_s) as deadline:
        return await _next_message(call, lambda: deadline.reschedule(loop.time() + timeout_s))


class EngineStream:
    """An engine's Generate stream that has produced its first message."""

    def __init__(
        self,
        engine: EngineView,
        call: grpc.aio.UnaryStreamCall,
        first: engine_pb2.GenerateResponse,
        pool: EnginePool,
        stall_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self._call = call
        self._pending: engine_pb2.GenerateResponse | None = first
        self._pool = pool
        self._stall_s = stall_s
        self._closed = False
        # Stall watchdog (see read): when the last message came, whether a read is waiting,
        # whether the watchdog fired, and its timer.
        self._last_message_at = 0.0
        self._waiting = False
        self._stalled = False
        self._watchdog: asyncio.TimerHandle | None = None

    async def read(self) -> engine_pb2.GenerateResponse | None:
        """The next message; None once the stream has ended; EngineStalledError on a stall.

        The stall deadline is one timer per stream that re-arms itself from the time of the
        last message, not a timeout around every read: a relayed token then costs a clock
        read instead of a timer scheduled and cancelled (the router's per-token CPU is what
        the engine loses to it on a shared machine).
        """
        if self._pending is not None:
            message, self._pending = self._pending, None
            return message
        if self._stall_s <= 0:
            return await _read(self._call, 0.0)
        loop = asyncio.get_running_loop()
        self._last_message_at = loop.time()
        if self._watchdog is None:
            self._watchdog = loop.call_at(self._last_message_at + self._stall_s, self._check)
        self._waiting = True
        try:
            received = await _next_message(self._call, self._note_keepalive)
            if received is None and self._stalled:
                raise self._stalled_error()
            return received
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._stalled or (task is not None and task.cancelling()):
                raise  # the consumer itself is being cancelled
            raise self._stalled_error() from None
        finally:
            self._waiting = False

    def _note_keepalive(self) -> None:
        self._last_message_at = asyncio.get_running_loop().time()

    def _check(self) -> None:
        """The watchdog's timer: cancel the call after `stall_s` of silence while a read
        waits (the read then raises EngineStalledError), else re-arm for the silence left."""
        self._watchdog = None
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        silent_since = self._last_message_at if self._waiting else loop.time()
        if self._waiting and loop.time() - silent_since >= self._stall_s:
            self._stalled = True
            self._call.cancel()
            return
        self._watchdog = loop.call_at(silent_since + self._stall_s, self._check)

    def _stalled_error(self) -> EngineStalledError:
        engine_id = self.engine.engine_id
        self._pool.mark_suspect(engine_id, self.engine.address)
        self.close()
        return EngineStalledError(
            f"engine {engine_id} stalled: no progress for {self._stall_s:g}s "
            f"(--stream-stall-timeout); the stream was ended and its request cancelled"
        )

    async def abort(self, request_id: str) -> engine_pb2.GenerateResponse | None:
        """Abort the request (stop string hit); returns the engine's final message if it came."""
        stub = self._pool.stub(self.engine.engine_id, self.engine.address)
        try:
            await stub.Abort(
                engine_pb2.AbortRequest(request_id=request_id),
                timeout=ABORT_DRAIN_S,
                metadata=trace_metadata() + self._pool.credential,
            )
            return await asyncio.wait_for(self._last_message(), ABORT_DRAIN_S)
        except (grpc.aio.AioRpcError, TimeoutError, EngineStalledError) as e:
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
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if not self._closed:
            self._closed = True
            self._call.cancel()  # no-op when finished; otherwise the engine frees the request
            self._pool.end(self.engine.engine_id)


async def open_engine_stream(
    ranking: Sequence[EngineView],
    pool: EnginePool,
    request: engine_pb2.GenerateRequest,
    max_attempts: int,
    deadlines: StreamDeadlines = NO_DEADLINES,
    on_retry: Callable[[str], None] | None = None,
    claims: PendingClaims | None = None,
) -> EngineStream:
    """Start `request` on the first engine of `ranking` that produces a first token.

    `on_retry(reason)` is called each time a failed attempt sends the request on to the next
    engine (reason: the failure's status code name, lower case). `claims` (the decision's
    prompt blocks) are marked pending on each engine tried, and released again when it fails.
    OverloadedError when every engine tried said its queue is full, else UnavailableError.
    """
    failures: list[tuple[grpc.StatusCode, str]] = []
    candidates = ranking[:max_attempts]
    for attempt, engine in enumerate(candidates):
        stream = await _attempt(engine, pool, request, failures, deadlines, claims)
        if stream is not None:
            return stream
        if on_retry is not None and attempt + 1 < len(candidates):
            on_retry(failures[-1][0].name.lower())
    summary = "; ".join(text for _, text in failures)
    if failures and all(code is grpc.StatusCode.RESOURCE_EXHAUSTED for code, _ in failures):
        raise OverloadedError(f"every engine is at capacity: {summary}")
    raise UnavailableError(f"no engine could take the request: {summary}")


async def _attempt(
    engine: EngineView,
    pool: EnginePool,
    request: engine_pb2.GenerateRequest,
    failures: list[tuple[grpc.StatusCode, str]],
    deadlines: StreamDeadlines,
    claims: PendingClaims | None = None,
) -> EngineStream | None:
    """One engine tried: its stream, or None after recording why it failed."""
    stream = None
    try:
        stream = await _attempt_stream(engine, pool, request, failures, deadlines, claims)
        return stream
    finally:
        if stream is None and claims is not None:
            claims.release(engine)


async def _attempt_stream(
    engine: EngineView,
    pool: EnginePool,
    request: engine_pb2.GenerateRequest,
    failures: list[tuple[grpc.StatusCode, str]],
    deadlines: StreamDeadlines,
    claims: PendingClaims | None,
) -> EngineStream | None:
    call = pool.stub(engine.engine_id, engine.address).Generate(
        request, metadata=deadlines.metadata() + pool.credential
    )
    prefill_tokens = 0
    if claims is not None:
        claims.claim(engine)  # in the background: the request is not held up
        prefill_tokens = claims.uncached_tokens(engine.engine_id)
    pool.begin(engine.engine_id, prefill_tokens)
    try:
        first = await _read(call, deadlines.first_token_s)
    except TimeoutError:
        call.cancel()  # the engine frees the request whenever it wakes up
        pool.end(engine.engine_id)
        pool.mark_suspect(engine.engine_id, engine.address)
        text = (f"{engine.engine_id}: stalled, no progress for {deadlines.first_token_s:g}s "
                f"before the first token (--first-token-timeout)")
        logger.warning("%s; trying the next engine", text)
        failures.append((grpc.StatusCode.DEADLINE_EXCEEDED, text))
        return None
    except grpc.aio.AioRpcError as e:
        pool.end(engine.engine_id)
        pool.note_failure(engine.engine_id, engine.address, e)
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
    finally:
        pool.prefilled(engine.engine_id, prefill_tokens)
    if first is None:
        pool.end(engine.engine_id)
        failures.append(
            (grpc.StatusCode.UNAVAILABLE, f"{engine.engine_id}: stream ended without a message")
        )
        return None
    return EngineStream(engine, call, first, pool, deadlines.stall_s)
