"""Keep-alive messages on Engine.Generate streams: how a caller tells slow from stalled.

Role: the contract between an engine and its caller (the router) for progress that
produces no token yet: a request queued behind others, a long chunked prefill, a
preempted request waiting to be recomputed. A caller that sends the gRPC metadata
`kvfleet-keepalive-s: S` on Generate gets an empty `GenerateResponse` (no token_ids, no
finish_reason, no prompt_logprobs; engine_id set) whenever S seconds pass without a
message on the stream *and the engine's step loop advanced in the meantime*. So a stream
that stays silent for well over S seconds means the engine is not stepping at all (its
process stopped, its loop wedged in a step, or one step is slower than that).

Invariants:
- Without the metadata nothing changes: one message per step with new tokens, as before.
- Keep-alives never carry tokens, and callers drop them (`is_keepalive`) before anything
  reaches a client.
- Importable without torch (the router uses it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvfleet.v1 import engine_pb2

METADATA_KEY = "kvfleet-keepalive-s"
# A caller cannot make the engine wake up more often than this per stream.
MIN_INTERVAL_S = 0.05


def metadata(interval_s: float | None) -> tuple[tuple[str, str], ...]:
    """The metadata asking for keep-alives every `interval_s` (none when None)."""
    if interval_s is None:
        return ()
    return ((METADATA_KEY, f"{max(interval_s, MIN_INTERVAL_S):.3f}"),)


def parse_interval(metadata: Iterable[tuple[str, str | bytes]] | None) -> float | None:
    """The requested interval, or None; ValueError naming the key when it is not usable."""
    for key, value in metadata or ():
        if key != METADATA_KEY:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        try:
            interval = float(text)
        except ValueError:
            interval = math.nan
        if not math.isfinite(interval) or interval < MIN_INTERVAL_S:
            raise ValueError(
                f"{METADATA_KEY} metadata must be a number of seconds >= {MIN_INTERVAL_S}, "
                f"got {text!r}"
            )
        return interval
    return None


def is_keepalive(message: engine_pb2.GenerateResponse) -> bool:
    return not (
        message.token_ids or message.HasField("finish_reason") or message.prompt_logprobs
    )
