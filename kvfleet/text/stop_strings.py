"""Stop strings on streamed text: the router applies them to engine streams, `LLM` offline.

Role: `StopStringMatcher.add(text)` returns the text that is safe to send and, once a stop
string appears, which one; the caller then aborts the engine request. Output paths use it
through `kvfleet.text.output_rules.StopStringFilter`, which adds min_tokens and token-by-token
matching.

Invariants (vLLM's semantics):
- Text that could still be the start of a stop string is held back (up to the longest stop
  string minus one character), so a client never sees text past a stop string.
- Only occurrences that end in newly added text count, and only when `check` is true; the
  caller passes `check=False` until `min_tokens` tokens exist, so earlier occurrences are
  emitted as ordinary text and never match later.
- On a match, the output ends right before the stop string (or right after it with
  `include_stop_str_in_output`); the earliest-ending occurrence wins.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        for index, value in enumerate(stop):
            if not value:
                raise ValueError(f"sampling_params.stop[{index}] must not be empty")
        self._stop = list(stop)
        self._include = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._stop)

    def add(self, text: str, check: bool = True) -> str:
        """Append `text`; return what may be emitted now (sets `matched` on a stop string)."""
        if self.matched is not None:
            return ""
        if not self._stop:
            return text
        old_len = len(self._pending)
        self._pending += text
        if check and text:
            hit = self._find(old_len)
            if hit is not None:
                return self._finish_match(*hit)
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back text, at the end of the stream (no stop string matched)."""
        out, self._pending = self._pending, ""
        return "" if self.matched is not None else out

    def _find(self, old_len: int) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            # Occurrences must end in the new text: start at or after old_len - len + 1.
            start = self._pending.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _finish_match(self, start: int, stop: str) -> str:
        self.matched = stop
        end = start + len(stop) if self._include else start
        out, self._pending = self._pending[:end], ""
        return out
