"""Polling for conditions that other processes make true (registration, Redis state, exits)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str = "condition",
) -> T:
    """Poll until `predicate()` is truthy; returns its value, AssertionError on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s}s waiting for {what} (last: {value!r})"
            )
        time.sleep(interval_s)
