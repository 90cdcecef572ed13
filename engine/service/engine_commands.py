"""The commands the engine thread of `AsyncEngine` drains from its queue between steps (and,
for adds, between the layers of a paused step: engine.core.urgent_step).

Invariant: a command never raises into the loop on behalf of its caller: a `Call` hands its
result or exception to its Future; an `Add` reports whether the request is now in the engine.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
Command = Callable[[], object]


class Call(Generic[T]):
    """A command whose result (or exception) goes to a concurrent Future."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def __call__(self) -> None:
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.fn())
            except BaseException as exc:  # delivered to the caller, never kills the loop
                self.future.set_exception(exc)


@dataclass(frozen=True)
class Add:
    """The command adding one request: a type of its own, so that a step paused between
    layers can pick out the adds that qualify for an urgent step (engine.core.urgent_step)."""

    request_id: str
    add: Callable[[], bool]  # True: the request is in the engine

    def __call__(self) -> bool:
        return self.add()
