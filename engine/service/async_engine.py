"""`AsyncEngine`: the synchronous `LLMEngine` driven by a dedicated thread, for asyncio servers.

Role: gRPC handlers call `generate()` (an async iterator of per-step token deltas) and
`abort()`; the engine thread runs `step()` whenever requests are unfinished and sleeps on a
condition variable otherwise (no busy loop, and the event loop never runs a model step).

Threading model (why no lock around the engine is needed):
- Only the engine thread touches `LLMEngine` mutable state. Everything else reaches it through
  a command queue drained by the engine thread *between* steps (`_submit`,
  `call_in_engine_thread`). `LLMEngine.validate_request` is the one exception: it reads only
  values fixed at start-up (vocabulary, max_model_len, pool size), so `generate()` calls it on
  the event loop to refuse bad input before anything is queued.
- Outputs go back with one `loop.call_soon_threadsafe` per step; per-request asyncio queues
  live on the event loop only.
- `load` is an immutable snapshot replaced after each engine iteration: safe to read anywhere.

Invariants:
- A stream ends with exactly one final item (`finished=True`) or one exception.
- If a consumer stops iterating early (break, cancellation, generator close), its request is
  aborted in the engine, which frees its KV blocks.
- One request's failure never stops the loop: a failed add fails that request only; an
  unexpected error inside `step()` (cannot be pinned on one request) fails the requests in
  flight and the loop keeps serving new ones.
- Outputs are tagged with a per-stream sequence number, so a request id reused right after
  a cancelled stream never receives the old request's tokens.
- `progress` (a `StepProgress` snapshot, replaced at the start of every iteration and before
  idling) is what `step_watchdog` judges; `generate(keepalive_s=...)` yields empty outputs
  while the loop advances without tokens for the request (`kvfleet.contracts.keepalive`).
- Urgent steps (engine.core.urgent_step, when on): between the layers of a step the engine thread
  takes the queued adds out of the command queue, adds them, and serves those that qualify
  at once; the other commands keep their order and wait for the step's end. Before each
  ordinary step, the waiting requests that are due (`UrgentSteps.due`) get a step of their own.
- If the engine thread dies (an exception escapes the loop), every stream ends with
  UnavailableError, new requests are refused, and `progress.failure` says why, for good.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from engine.core.kv_cache_manager import KVCacheEvents
from engine.core.llm_engine import LLMEngine
from engine.core.request import TenantShare
from engine.core.scheduler_output import RequestUpdate
from engine.disagg.kv_imports import ImportedStart
from engine.service.engine_commands import Add as _Add
from engine.service.engine_commands import Call as _Call
from engine.service.engine_commands import Command as _Command
from engine.service.engine_state import EngineLoad, GenerateOutput, StepProgress
from engine.service.engine_thread import EngineThread
from engine.service.prefill_work import StepRates
from kvfleet.contracts.block_hash import BlockHash
from kvfleet.contracts.errors import OverloadedError, UnavailableError
from kvfleet.contracts.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Called on the engine thread after every iteration that did work, with the KV events of
# that iteration (possibly empty: load changed). Must not block.
StepListener = Callable[[KVCacheEvents], None]
# Called on the engine thread with the request updates of a step (stepped=True) or of an
# abort (a finished update with no tokens, stepped=False). Must not block.
UpdateListener = Callable[[Sequence[RequestUpdate], bool], None]
# (request id, stream sequence number, output or the exception that ends the stream)
_Delivery = tuple[str, int, "GenerateOutput | BaseException"]
# A wedged step must not hang shutdown (the thread is a daemon: the process still ends).
SHUTDOWN_JOIN_S = 10.0


@dataclass
class _Stream:
    seq: int
    queue: asyncio.Queue[GenerateOutput | BaseException] = field(default_factory=asyncio.Queue)


async def _next_item(queue: asyncio.Queue[T], timeout_s: float | None) -> T | None:
    """The queue's next item; None if `timeout_s` passes first (Queue.get is cancel-safe)."""
    if timeout_s is None:
        return await queue.get()
    try:
        async with asyncio.timeout(timeout_s):
            return await queue.get()
    except TimeoutError:
        return None


class AsyncEngine:
    """Owns an `LLMEngine` (and its kv_event_hook) and drives it from one thread."""

    def __init__(self, engine: LLMEngine, max_concurrent_requests: int | None = None) -> None:
        self._engine = engine
        # TGI's --max-concurrent-requests: beyond it new requests are refused (the router
        # then tries another engine, or answers RESOURCE_EXHAUSTED / HTTP 429).
        self._max_concurrent = max_concurrent_requests
        self._cond = threading.Condition()
        self._commands: collections.deque[_Command] = collections.deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: tuple[StepListener, ...] = ()
        self._update_listeners: tuple[UpdateListener, ...] = ()
        # Event-loop side: live streams by request id.
        self._streams: dict[str, _Stream] = {}
        self._seq = itertools.count()
        # Engine-thread side: request id -> stream seq of requests inside the engine, and
        # the KV events (device and host tier) collected since the last listener call.
        self._live: dict[str, int] = {}
        self._events = KVCacheEvents([], [])
        # Measured from the steps (engine thread), published with the load for the routers.
        self._rates = StepRates()
        self._load = EngineLoad.of(engine)
        engine.urgent.poll = self._poll_new_requests
        self._progress = StepProgress(iterations=0, at=time.monotonic(), idle=True)
        self._failure: str | None = None  # why the engine thread died
        engine.kv_event_hook = self._collect_kv_events

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def engine(self) -> LLMEngine:
        """The wrapped engine. Its mutable state belongs to the engine thread."""
        return self._engine

    @property
    def load(self) -> EngineLoad:
        return self._load

    @property
    def progress(self) -> StepProgress:
        """The engine loop's latest heartbeat (safe to read from any thread)."""
        return self._progress

    def start(self, thread: EngineThread | None = None) -> None:
        """Start the engine loop; call from the event loop that will consume outputs. With
        `thread`, the loop runs there, on the thread that built the engine (see
        engine.service.engine_thread for why); otherwise on a new thread."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._loop = asyncio.get_running_loop()
        if thread is not None:
            thread.run_last(self._run)  # raises (nothing started) if the thread is closed
            self._thread = thread.thread
            return
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; streams still open end with UnavailableError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, SHUTDOWN_JOIN_S)
            if self._thread.is_alive():
                logger.error("engine thread still inside a step after %.0fs; leaving it",
                             SHUTDOWN_JOIN_S)
        self._fail_streams(UnavailableError("engine is shutting down"))

    def add_step_listener(self, listener: StepListener) -> None:
        # Copy-on-write: the engine thread iterates the tuple without a lock.
        self._listeners = (*self._listeners, listener)

    def add_update_listener(self, listener: UpdateListener) -> None:
        self._update_listeners = (*self._update_listeners, listener)

    # -- requests --------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        keepalive_s: float | None = None,
        share: TenantShare | None = None,
        lora_name: str | None = None,
        prefill_only: bool = False,
        imported: ImportedStart | None = None,
    ) -> AsyncIterator[GenerateOutput]:
        """Queue a request and yield its outputs; ValueError (nothing queued) if invalid.

        With `keepalive_s`: an empty output whenever that long passes without one while the
        engine loop has advanced. `prefill_only` / `imported`: the two halves of a
        disaggregated request (engine.disagg).
        """
        self._check_running()
        prompt = list(prompt_token_ids)
        self._engine.validate_request(prompt, params)
        self._engine.resolve_lora(lora_name)  # a name lookup: refuses an unserved adapter now
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self._max_concurrent is not None and len(self._streams) >= self._max_concurrent:
            raise OverloadedError(
                f"engine is at capacity: {len(self._streams)} requests in flight "
                f"(max_concurrent_requests={self._max_concurrent})"
            )
        stream = _Stream(next(self._seq))
        self._streams[request_id] = stream
        queued = self._submit(
            _Add(request_id, functools.partial(
                self._add, request_id, stream.seq, prompt, params, priority, cache_salt, share,
                lora_name, prefill_only, imported,
            ))
        )
        if not queued:  # the loop stopped or died since the check above
            del self._streams[request_id]
            self._check_running()
        finished = False
        seen = self._progress.iterations  # for keep-alives: has the loop advanced since?
        try:
            while not finished:
                item = await _next_item(stream.queue, keepalive_s)
                if item is None:
                    if self._progress.iterations != seen:
                        seen = self._progress.iterations
                        yield GenerateOutput(request_id, [], finished=False)
                    continue
                seen = self._progress.iterations
                if isinstance(item, BaseException):
                    finished = True  # the engine no longer holds this request
                    raise item
                finished = item.finished
                yield item
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:  # consumer left early: free the request's blocks
                self._submit(functools.partial(self._abort, request_id, stream.seq))

    async def abort(self, request_id: str) -> bool:
        """Abort a live request (its stream ends with finish_reason "abort"); False if none."""
        self._check_running()
        future = self.call_in_engine_thread(functools.partial(self._abort, request_id, None))
        return await asyncio.wrap_future(future)

    def call_in_engine_thread(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the engine thread between steps (may be called from any thread)."""
        call = _Call(fn)
        if not self._submit(call):
            call.future.set_exception(RuntimeError("engine is not running"))
        return call.future

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache. Engine thread only (see call_in_engine_thread)."""
        return list(self._engine.kv.pool.cached)

    def host_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache's host tier (none without one). Engine thread only."""
        tier = self._engine.kv.host_tier
        return [] if tier is None else tier.hashes()

    # -- event-loop side helpers -----------------------------------------------------------

    def _check_running(self) -> None:
        if self._failure is not None:
            raise UnavailableError(self._failure)
        if self._thread is None or self._stopping:
            raise UnavailableError("engine is not running")

    def _submit(self, command: _Command) -> bool:
        with self._cond:
            if self._stopping or self._failure is not None:
                return False
            self._commands.append(command)
            self._cond.notify()
        return True

    def _dispatch(self, deliveries: list[_Delivery]) -> None:
        for request_id, seq, item in deliveries:
            stream = self._streams.get(request_id)
            if stream is not None and stream.seq == seq:
                stream.queue.put_nowait(item)

    def _fail_streams(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(exc)

    # -- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # nothing will step again: say so instead of hanging
            self._die(exc)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._commands or self._stopping or self._has_work()):
                    self._mark_progress(idle=True)
                    self._cond.wait()
                if self._stopping:
                    self._cancel_calls()
                    return
                commands = list(self._commands)
                self._commands.clear()
            self._mark_progress(idle=False)
            for command in commands:
                try:
                    command()
                except Exception:  # a command's failure is its own; the loop carries on
                    logger.exception("engine command failed")
            self._run_urgent(self._engine.urgent.due())
            if self._has_work():
                self._step()
            self._after_iteration()

    def _mark_progress(self, idle: bool) -> None:
        iterations = self._progress.iterations + (0 if idle else 1)
        self._progress = StepProgress(iterations, time.monotonic(), idle)

    def _die(self, exc: BaseException) -> None:
        reason = f"engine thread died: {type(exc).__name__}: {exc}"
        logger.critical("%s; failing %d request(s), refusing new ones", reason, len(self._live),
                        exc_info=exc)
        with self._cond:
            self._failure = reason
            self._progress = replace(self._progress, failure=reason)
            self._cancel_calls()
        self._live.clear()
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._fail_streams, UnavailableError(reason))

    def _cancel_calls(self) -> None:
        # Callers of call_in_engine_thread must not wait forever on a stopped engine.
        for command in self._commands:
            if isinstance(command, _Call):
                command.future.cancel()
        self._commands.clear()

    def _has_work(self) -> bool:
        return self._engine.has_unfinished_requests()

    def _step(self) -> None:
        try:
            self._rates.before_step(self._engine)
            updates = self._engine.step()
            self._rates.after_step(self._engine)
        except Exception as exc:
            logger.exception("engine step failed; failing the %d request(s) in flight",
                             len(self._live))
            self._fail_all(exc)
            return
        self._publish(updates)

    def _publish(self, updates: Sequence[RequestUpdate]) -> None:
        """A step's updates to the listeners and the requests' streams."""
        self._notify_updates(updates, stepped=True)
        deliveries: list[_Delivery] = []
        for update in updates:
            request_id = update.request.request_id
            seq = self._live.get(request_id)
            if seq is None:
                continue
            if update.finished:
                del self._live[request_id]
            output = GenerateOutput.of(
                update.request, update.new_token_ids, update.finished, update.new_logprobs,
                update.prompt_logprobs,
            )
            deliveries.append((request_id, seq, output))
        self._deliver(deliveries)

    def _poll_new_requests(self, layer: int) -> None:
        """Between two layers of a step (engine.core.urgent_step): queued adds leave the command
        queue and are added now; those that qualify are served in an urgent step at once."""
        if not self._commands:  # the common case, without taking the lock
            return
        with self._cond:
            adds = [c for c in self._commands if isinstance(c, _Add)]
            for add in adds:
                self._commands.remove(add)
        added = [add.request_id for add in adds if add()]
        self._run_urgent(self._engine.urgent.qualifying(added))

    def _run_urgent(self, request_ids: Sequence[str]) -> None:
        """An urgent step (engine.core.urgent_step) for these waiting requests: inside the paused
        step, or before the next ordinary step, which would otherwise put them in one step
        with the prompt chunks they are ranked ahead of."""
        if not request_ids:
            return
        try:
            updates = self._engine.urgent.run(request_ids)
        except Exception as exc:  # only the urgent step's requests are lost; the paused
            logger.exception("urgent step failed")  # step goes on
            self._fail_requests(request_ids, exc)
            return
        self._publish(updates)

    def _fail_all(self, exc: Exception) -> None:
        self._fail_requests(list(self._live), exc)

    def _fail_requests(self, request_ids: Sequence[str], exc: Exception) -> None:
        """Abort these live requests (their streams end with the step's error)."""
        deliveries: list[_Delivery] = []
        for request_id in request_ids:
            seq = self._live.pop(request_id, None)
            if seq is None:
                continue
            try:
                request = self._engine.abort_request(request_id)
                if request is not None:
                    self._notify_updates([RequestUpdate(request, [], True)], stepped=False)
            except Exception:
                logger.exception("could not abort %s after a failed step", request_id)
            deliveries.append((request_id, seq, RuntimeError(f"engine step failed: {exc}")))
        self._deliver(deliveries)

    def _add(
        self,
        request_id: str,
        seq: int,
        prompt: list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        share: TenantShare | None = None,
        lora_name: str | None = None,
        prefill_only: bool = False,
        imported: ImportedStart | None = None,
    ) -> bool:
        try:
            if imported is not None:
                self._engine.add_imported_request(
                    request_id, prompt, imported.first_token_id, params,
                    transfer_id=imported.transfer_id,
                    num_cached_tokens=imported.num_cached_tokens, priority=priority,
                    cache_salt=cache_salt, share=share,
                )
            else:
                self._engine.add_request(
                    request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                    share=share, lora_request=lora_name, prefill_only=prefill_only,
                )
        except Exception as exc:
            if not isinstance(exc, ValueError):
                logger.exception("could not add request %s", request_id)
            self._deliver([(request_id, seq, exc)])
            return False
        self._live[request_id] = seq
        return True

    def _abort(self, request_id: str, seq: int | None) -> bool:
        live_seq = self._live.get(request_id)
        if live_seq is None or (seq is not None and seq != live_seq):
            return False
        del self._live[request_id]
        request = self._engine.abort_request(request_id)
        if request is None:
            return False
        self._notify_updates([RequestUpdate(request, [], True)], stepped=False)
        self._deliver([(request_id, live_seq, GenerateOutput.of(request, [], finished=True))])
        return True

    def _notify_updates(self, updates: Sequence[RequestUpdate], stepped: bool) -> None:
        for listener in self._update_listeners:
            try:
                listener(updates, stepped)
            except Exception:  # a broken listener must not stop serving
                logger.exception("update listener failed")

    def _deliver(self, deliveries: list[_Delivery]) -> None:
        if not deliveries or self._loop is None:
            return
        # RuntimeError: the event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._dispatch, deliveries)

    def _collect_kv_events(self, events: KVCacheEvents) -> None:
        self._events.extend(events)

    def _after_iteration(self) -> None:
        events, self._events = self._events, KVCacheEvents([], [])
        self._load = EngineLoad.of(self._engine, self._rates)
        for listener in self._listeners:
            try:
                listener(events)
            except Exception:  # a broken listener must not stop serving
                logger.exception("step listener failed")
