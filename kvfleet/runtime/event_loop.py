"""The event loop a kvfleet service runs on: uvloop where it is installed, else asyncio's.

Why: a service's per-token work is event-loop work (a router relays every token as a gRPC read
and an HTTP write; an engine sends every token as a gRPC message), and on a CPU host it takes
cycles from the engine's compute threads. uvloop's C loop and transports cut the router's CPU
per relayed token by ~20% here (SmolLM2, 64 streams of 64 tokens, httptools also installed:
0.80-0.88 s of router CPU a round against 1.03-1.07 with asyncio and h11). vLLM's API server
runs on uvloop too.

Invariant: the choice changes nothing a client can see; "auto" falls back to asyncio's loop
where uvloop cannot be imported (it is a pinned dependency, but embedders may lack it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


def loop_factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """A constructor of the loop `kind` names; ValueError for "uvloop" when it is missing."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {kind!r}")
    if kind == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed") from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """asyncio.run on the loop `kind` names."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)
