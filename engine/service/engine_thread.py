"""`EngineThread`: the one OS thread of an engine process that runs torch work. It builds the
engine (model load, GEMM backend measurement, LoRA adapters given at start) and then runs the
engine loop (`AsyncEngine.start(thread=...)`).

Why one thread: every thread that runs a parallel torch op becomes the master of its own
OpenMP thread pool, and the pools outlive the work. Built on one thread (an asyncio executor
worker, say) and stepped on another, an engine process holds two pools: four OpenMP-managed
threads on a two-core machine. libgomp then throttles its spin-wait (more managed threads
than CPUs: `GOMP_SPINCOUNT`'s throttled value, ~100 spins), so the workers fall asleep after
every op and each of the hundreds of parallel regions of a step waits for a futex wake-up.
Measured on SmolLM2-135M, two cores, 64 decoding requests: 185 ms a decode step with one
pool, 226 ms with two; the served benchmark saw the same gap against the offline one.

Invariants:
- Jobs run one at a time, in submission order, on the same daemon thread (a wedged step
  never keeps the process from exiting).
- A job's exception goes to its future only; the thread carries on with the next job.
- After `close()` (or once the engine loop, submitted with `run_last`, returns) the thread ends
  and further submissions fail with RuntimeError.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from kvfleet.runtime.thread_names import name_os_thread

T = TypeVar("T")

_Job = tuple[Callable[[], object], "concurrent.futures.Future[object]", bool]


class EngineThread:
    def __init__(self, name: str = "engine-loop") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the thread after the jobs already submitted."""
        return self._put(fn, last=False)

    def run_last(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` (the engine loop) as the thread's final job: the thread ends after it."""
        return self._put(fn, last=True)

    def close(self) -> None:
        """End the thread once the jobs already submitted have run."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)

    def _put(self, fn: Callable[[], T], last: bool) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("engine thread is closed")
            self._jobs.put((fn, future, last))  # type: ignore[arg-type]
            if last:
                self._closed = True
        return future

    def _work(self) -> None:
        name_os_thread()  # tells the step loop's CPU time from torch's threads' in /proc
        while (job := self._jobs.get()) is not None:
            fn, future, last = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # the job's failure is its caller's to see
                    future.set_exception(exc)
            if last:
                return
