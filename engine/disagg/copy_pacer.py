"""Paces a decode engine's KV import copies against its steps: at most one batch per step.

Role: the handoff's copier thread (engine.core.kv_handoff) writes an import's blocks beside
the steps. Free-running, a 2,000-token import (tens of MB) overlaps one or two steps with
its whole copy, and those steps slow down by about the copy's length (memory bandwidth,
and the core when the engine shares it). `CopyPacer` lets one batch run per step instead:
the copy is spread thinly over a few steps, and no step carries more than one batch.

Invariants:
- `stepping` is entered by the engine thread around each step's forward pass; `turn` by
  the copier thread before each batch. A batch starts at once when no step is running, or
  once a step later than the one the previous batch overlapped has started; it never waits
  longer than `max_wait_s` (a wedged or very long step must not stall imports forever).
- Pacing only orders work in time: the blocks copied, and so the KV, are the same.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

# A step of the engines this was measured on takes tens of ms; a batch never waits longer.
DEFAULT_MAX_WAIT_S = 0.25


class CopyPacer:
    def __init__(self, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        self._max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._steps = 0  # steps started so far
        self._stepping = False
        self._last_overlapped = -1  # the step the last batch ran beside

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around a step's forward pass (engine thread)."""
        with self._cond:
            self._steps += 1
            self._stepping = True
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._stepping = False
                self._cond.notify_all()

    def turn(self) -> None:
        """Wait (copier thread) until a batch may run: no step running, or a new one."""
        with self._cond:
            self._cond.wait_for(
                lambda: not self._stepping or self._steps != self._last_overlapped,
                timeout=self._max_wait_s)
            # The step it runs beside (or the one about to start, if none runs now).
            self._last_overlapped = self._steps if self._stepping else self._steps + 1
