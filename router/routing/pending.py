"""Pending entries: the prompt blocks a decision just sent to an engine, seen by every router.

Role: an engine publishes the blocks of a prompt only once it has computed them, a queue wait
and a prefill (seconds on a busy engine) after the request arrived. Until then every other
request of that prefix would look like a miss everywhere, and the prefix would be computed
again on whichever engine looked cheapest. So once a decision has chosen an engine,
`PendingClaims.claim` writes the blocks that engine lacks to its pending ZSET
(`kvfleet.contracts.redis_schema.pending_key`), and the lookup of the next decision, on this
replica or any other, counts them as matched there (`matched_pending_blocks`) at no compute
cost: that request waits for the blocks being computed instead of computing them again.

Invariants:
- Off the critical path: `claim` and `release` start background writes and return at once;
  the request is sent without waiting for Redis, and a failed write is only logged (the next
  decision then sees a miss, as without pending entries). Writing in the lookup script
  instead would save nothing: the choice is made here, after the lookup, and a Lua copy of
  the cost model would have to follow it.
- A claim counts for `min_ttl_s + ttl_factor x` the chosen engine's estimated time to first
  token (capped by `redis_schema.PENDING_MAX_TTL_S`), long enough for the engine to compute
  and publish the blocks, after which its own sets supersede the entry; a request that dies
  without computing them leaves its entries only that long.
- `release` (the engine refused the request before accepting it) removes the claim's entries,
  after its write has landed (writes of one claim run in order). It may remove an entry
  another request of the same prefix also claimed there; that engine is refusing requests,
  so it should not attract more of that prefix anyway.
- Nothing is written for an engine without an epoch (found without Redis).
- This replica sees its own claims at once (`LocalPending`, consulted by its next decision
  after the Redis lookup): a burst of one prefix arriving together decides several times
  before the first background write lands, and without the local view each of those would
  take the prefix for a miss. The local view only extends a run where Redis' answer stops,
  so a claim already in Redis is never counted twice.
- A decision holds its first engine at once (`PendingClaims.reserve`): its blocks are claimed
  there and the request counts as one of this router's in flight and prefilling there
  (`Reservations`, added to `EnginePool`'s counts by `router.routing.decision`) until the
  dispatcher sends it (`claim`: the pool's own counts take over in the same step) or gives it
  up (`cancel`: the claim then just expires), at the latest after the claim's TTL. Between
  the decision and the send the request waited (a context-window GetLoad, a busy event loop:
  250 ms and more in a measured burst); every decision made meanwhile saw the engines
  without it, and at rate inf four new prefixes went to one engine of two that way
  (`make bench-fleet`, the README's Fleet section). The GetLoad is gone from that gap (the
  published max_model_len is used); `held_s` measures what is left.
- The engine held is the one the request is sent to first, which the caller names
  (`router.engines.disagg.first_engine`: a prefill engine in a disaggregated fleet); without
  the caller's rules, only a first engine taking whole requests (role both) is held.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from router.routing.engine_view import EngineView
from router.routing.ttft_cost import Estimate

logger = logging.getLogger(__name__)


class PendingStore(Protocol):
    """Where pending entries live (`router.routing.prefix_index.PrefixIndex`)."""

    async def mark_pending(
        self, engine_id: str, epoch: str, hashes: Sequence[bytes], ttl_s: float
    ) -> None: ...

    async def unmark_pending(
        self, engine_id: str, epoch: str, hashes: Sequence[bytes]
    ) -> None: ...


@dataclass(frozen=True)
class PendingConfig:
    """How long a claim counts: min_ttl_s + ttl_factor x estimated time to first token."""

    min_ttl_s: float = 2.0
    ttl_factor: float = 3.0

    def __post_init__(self) -> None:
        if self.min_ttl_s <= 0 or self.ttl_factor < 0:
            raise ValueError("pending TTL must be positive")

    def ttl_s(self, estimate: Estimate | None) -> float:
        return self.min_ttl_s + self.ttl_factor * (estimate.ttft_s if estimate else 0.0)


class LocalPending:
    """This replica's own pending claims, by (engine id, epoch): hash -> expiry (monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[tuple[str, str], dict[bytes, float]] = {}

    def add(self, engine_id: str, epoch: str, hashes: Sequence[bytes], ttl_s: float) -> None:
        now = self._clock()
        key = (engine_id, epoch)
        entries = {h: t for h, t in self._entries.get(key, {}).items() if t > now}
        expiry = now + ttl_s
        for h in hashes:
            if entries.get(h, 0.0) < expiry:  # a shorter claim never shortens a longer one
                entries[h] = expiry
        self._entries[key] = entries

    def remove(self, engine_id: str, epoch: str, hashes: Sequence[bytes]) -> None:
        entries = self._entries.get((engine_id, epoch))
        if entries is not None:
            for h in hashes:
                entries.pop(h, None)

    def run(self, engine_id: str, epoch: str, hashes: Sequence[bytes], start: int) -> int:
        """How many of `hashes[start:]`, in order, this replica holds claimed there."""
        entries = self._entries.get((engine_id, epoch))
        if not entries:
            return 0
        now = self._clock()
        count = 0
        for h in hashes[start:]:
            if entries.get(h, 0.0) <= now:
                break
            count += 1
        return count


class Reservations:
    """Requests decided for an engine but not sent yet, by engine id: key -> (uncached
    prompt tokens, expiry). Each decision's entry is dropped when its request is sent or
    given up; the expiry only bounds a request that vanished between the two."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, dict[int, tuple[int, float]]] = {}
        self._keys = itertools.count()

    def now(self) -> float:
        return self._clock()

    def add(self, engine_id: str, tokens: int, ttl_s: float) -> int:
        key = next(self._keys)
        self._entries.setdefault(engine_id, {})[key] = (tokens, self._clock() + ttl_s)
        return key

    def drop(self, engine_id: str, key: int) -> None:
        entries = self._entries.get(engine_id)
        if entries is not None:
            entries.pop(key, None)
            if not entries:
                del self._entries[engine_id]

    def held(self, engine_id: str) -> tuple[int, int]:
        """(requests, their uncached prompt tokens) decided for the engine and not sent."""
        entries = self._entries.get(engine_id)
        if not entries:
            return 0, 0
        now = self._clock()
        live = {k: v for k, v in entries.items() if v[1] > now}
        if len(live) != len(entries):
            self._entries[engine_id] = live
        return len(live), sum(tokens for tokens, _ in live.values())


# Background writes, referenced until done (the loop keeps only weak references to tasks).
_TASKS: set[asyncio.Task[None]] = set()


class PendingClaims:
    """One decision's prompt blocks, claimable as pending on any engine of its ranking."""

    def __init__(
        self,
        store: PendingStore,
        hashes: Sequence[bytes],
        estimates: Mapping[str, Estimate],
        config: PendingConfig | None = None,
        local: LocalPending | None = None,
        reservations: Reservations | None = None,
    ) -> None:
        self._store = store
        self._local = local
        self._hashes = list(hashes)
        self._estimates = dict(estimates)
        self._config = config if config is not None else PendingConfig()
        self._claims: dict[str, asyncio.Task[None]] = {}
        self._reservations = reservations
        self._held: tuple[EngineView, int] | None = None  # (engine, reservation key)
        self._reserved_at = 0.0
        # Seconds from the decision to the send (or give-up): how long other decisions saw
        # the engine only through the reservation (None: nothing was held).
        self.held_s: float | None = None

    def uncached_tokens(self, engine_id: str) -> int:
        """Prompt tokens the request makes this engine compute (0 when not estimated)."""
        estimate = self._estimates.get(engine_id)
        return estimate.own_tokens if estimate is not None else 0

    def reserve(self, engine: EngineView) -> None:
        """Hold the engine from the decision on (module docstring): claim the blocks it lacks
        and count the request there until `claim` (it is sent) or `cancel`."""
        self.claim(engine)
        if self._reservations is not None and self._held is None:
            ttl = self._config.ttl_s(self._estimates.get(engine.engine_id))
            key = self._reservations.add(engine.engine_id,
                                         self.uncached_tokens(engine.engine_id), ttl)
            self._held = (engine, key)
            self._reserved_at = self._reservations.now()

    def cancel(self) -> None:
        """The request will not be sent (refused before dispatch, client gone): drop the
        reservation. Its claim stays until its TTL: removing it could remove the entry of
        another request of the prefix on that engine (the caveat of `release`), and an
        engine that did nothing wrong should keep attracting its prefix."""
        self._settle()

    def claim(self, engine: EngineView) -> None:
        """Mark the blocks this engine lacks as pending there (in the background); the
        request is being sent to it, so a reservation ends (the pool counts it from now)."""
        self._settle()
        hashes = self._missing(engine)
        if not hashes or engine.engine_id in self._claims:
            return
        ttl = self._config.ttl_s(self._estimates.get(engine.engine_id))
        if self._local is not None:
            self._local.add(engine.engine_id, engine.epoch, hashes, ttl)
        self._claims[engine.engine_id] = _spawn(
            self._store.mark_pending(engine.engine_id, engine.epoch, hashes, ttl), "mark"
        )

    def release(self, engine: EngineView) -> None:
        """Drop this engine's claim again (the request never got into it)."""
        claim = self._claims.pop(engine.engine_id, None)
        if claim is not None:
            hashes = self._missing(engine)
            if self._local is not None:
                self._local.remove(engine.engine_id, engine.epoch, hashes)
            _spawn(self._unmark(claim, engine, hashes), "unmark")

    def _settle(self) -> None:
        """End the reservation, if any."""
        held, self._held = self._held, None
        if held is not None and self._reservations is not None:
            self._reservations.drop(held[0].engine_id, held[1])
            self.held_s = self._reservations.now() - self._reserved_at
            logger.debug("held %s %.1f ms from decision to send", held[0].engine_id,
                         self.held_s * 1e3)

    async def _unmark(
        self, claim: asyncio.Task[None], engine: EngineView, hashes: list[bytes]
    ) -> None:
        await asyncio.wait([claim])  # the removal must not overtake the write
        await self._store.unmark_pending(engine.engine_id, engine.epoch, hashes)

    def _missing(self, engine: EngineView) -> list[bytes]:
        if not engine.epoch:
            return []
        # Pending ones are written again: their expiry moves to this claim's, if later.
        return self._hashes[engine.matched_blocks + engine.matched_host_blocks:]


async def drain() -> None:
    """Wait for every pending write started so far (tests, orderly shutdown)."""
    while _TASKS:
        await asyncio.wait(list(_TASKS))


def _spawn(work: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
    async def logged() -> None:
        try:
            await work
        except Exception as e:  # Redis down or busy: the entry is only an optimisation
            logger.debug("pending %s failed: %s", what, e)

    task = asyncio.ensure_future(logged())
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)
    return task
