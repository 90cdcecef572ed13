"""`StepWatchdog`: the engine's gRPC health follows whether its step loop is advancing.

Role: a task on the server's event loop that reads `AsyncEngine.progress` every
`interval_s` and reports NOT_SERVING (standard grpc.health.v1, through `set_serving`) while
the engine is stalled, SERVING again once it advances; `problem()` is the same judgement on
demand, which the servicer uses to refuse new requests with UNAVAILABLE (so a router
retries another engine at once instead of waiting for its first-token deadline).

Stalled means: the loop has work (it is not idling for lack of requests) and has not begun
a new iteration for more than `timeout_s` (`--watchdog-timeout`). One iteration is one model
step, so the timeout must exceed the longest legitimate step (a full
`--max-num-batched-tokens` prefill chunk on a busy machine); hence the generous default, as
vLLM's 60 s engine iteration timeout.

Invariants:
- An idle engine is never stalled, however long it waits for work.
- Once the engine thread has died the status is NOT_SERVING for good and `on_death` runs
  once (the server deregisters from Redis: the engine will never step again).
- `timeout_s` = 0 disables the stall check; death is always reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from engine.service.async_engine import StepProgress

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
# Longest pause between two checks; shorter timeouts are checked 4 times per timeout.
MAX_INTERVAL_S = 1.0

SetServing = Callable[[bool], Awaitable[None]]


def assess(progress: StepProgress, now: float, timeout_s: float) -> str | None:
    """Why the engine cannot serve (dead or stalled), or None when it is fine."""
    if progress.failure is not None:
        return progress.failure
    if progress.idle or timeout_s <= 0:
        return None
    silent_s = now - progress.at
    if silent_s <= timeout_s:
        return None
    return (
        f"engine stalled: its step loop has not advanced for {silent_s:.1f}s with requests "
        f"in flight (--watchdog-timeout {timeout_s:g}s)"
    )


class StepWatchdog:
    def __init__(
        self,
        progress: Callable[[], StepProgress],
        timeout_s: float,
        set_serving: SetServing,
        on_death: Callable[[], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._progress = progress
        self.timeout_s = timeout_s
        self._set_serving = set_serving
        self._on_death = on_death
        self._clock = clock
        self.interval_s = MAX_INTERVAL_S if timeout_s <= 0 else min(MAX_INTERVAL_S, timeout_s / 4)
        self._task: asyncio.Task[None] | None = None

    def problem(self) -> str | None:
        return assess(self._progress(), self._clock(), self.timeout_s)

    def start(self) -> None:
        """Start watching; call on the event loop that serves the health service."""
        if self._task is not None:
            raise RuntimeError("watchdog already started")
        self._task = asyncio.ensure_future(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        serving = True
        while True:
            await asyncio.sleep(self.interval_s)
            problem = self.problem()
            if (problem is None) != serving:
                serving = problem is None
                if serving:
                    logger.warning("engine step loop advancing again: health SERVING")
                else:
                    logger.error("%s: health NOT_SERVING", problem)
                await self._set_serving(serving)
            if self._progress().failure is not None:
                if self._on_death is not None:
                    await self._on_death()
                return  # dead for good: nothing more to watch
