"""A replica's own pending claims and holds, seen by its next decision before the request is
sent and before the Redis write lands."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from router.routing.engine_view import EngineView
from router.routing.pending import (
    LocalPending,
    PendingClaims,
    PendingConfig,
    Reservations,
    drain,
)
from router.routing.ttft_cost import Estimate

H = [bytes([i]) * 16 for i in range(8)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_run_counts_consecutive_live_claims_from_where_redis_stopped() -> None:
    clock = Clock()
    local = LocalPending(clock)
    local.add("a", "1", H[2:6], ttl_s=5)
    assert local.run("a", "1", H, start=2) == 4
    assert local.run("a", "1", H, start=0) == 0  # block 0 is not claimed: no run
    assert local.run("a", "1", H, start=3) == 3
    assert local.run("a", "2", H, start=2) == 0  # another epoch never matches
    assert local.run("b", "1", H, start=2) == 0


def test_claims_expire_and_a_shorter_one_never_shortens_a_longer_one() -> None:
    clock = Clock()
    local = LocalPending(clock)
    local.add("a", "1", H[:4], ttl_s=5)
    local.add("a", "1", H[:4], ttl_s=1)
    clock.now += 2
    assert local.run("a", "1", H, start=0) == 4
    clock.now += 4
    assert local.run("a", "1", H, start=0) == 0


def test_a_removed_claim_ends_the_run_there() -> None:
    local = LocalPending(Clock())
    local.add("a", "1", H, ttl_s=5)
    local.remove("a", "1", H[3:])
    assert local.run("a", "1", H, start=0) == 3


def test_reservations_count_live_holds_per_engine_until_dropped_or_expired() -> None:
    clock = Clock()
    held = Reservations(clock)
    one = held.add("a", 544, ttl_s=5)
    held.add("a", 32, ttl_s=1)
    held.add("b", 544, ttl_s=5)
    assert (held.held("a"), held.held("b"), held.held("c")) == ((2, 576), (1, 544), (0, 0))
    held.drop("a", one)
    held.drop("a", one)  # dropping twice is harmless
    assert held.held("a") == (1, 32)
    clock.now += 2
    assert (held.held("a"), held.held("b")) == ((0, 0), (1, 544))


class _Store:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    async def mark_pending(self, engine_id: str, epoch: str, hashes: Sequence[bytes],
                           ttl_s: float) -> None:
        self.calls.append(("mark", engine_id, len(hashes)))

    async def unmark_pending(self, engine_id: str, epoch: str, hashes: Sequence[bytes]) -> None:
        self.calls.append(("unmark", engine_id, len(hashes)))


def test_a_reserved_engine_is_held_until_sent_or_cancelled() -> None:
    engine = EngineView("a", "a:1", epoch="1", matched_blocks=2)
    estimates = {"a": Estimate("a", 1.0, 32, 96)}
    store, clock = _Store(), Clock()
    local, held = LocalPending(clock), Reservations(clock)

    async def run() -> None:
        sent = PendingClaims(store, H, estimates, PendingConfig(2.0, 3.0), local, held)
        sent.reserve(engine)
        sent.reserve(engine)  # one hold per decision
        assert held.held("a") == (1, 96)
        assert local.run("a", "1", H, start=2) == 6  # claimed at once, before any send
        sent.claim(engine)  # the dispatcher sends it: the pool counts it from here
        assert held.held("a") == (0, 0)
        dropped = PendingClaims(store, H, estimates, PendingConfig(2.0, 3.0), local, held)
        dropped.reserve(engine)
        dropped.cancel()  # never sent: the hold goes, the claim expires by itself
        assert held.held("a") == (0, 0)
        assert local.run("a", "1", H, start=2) == 6
        await drain()

    asyncio.run(run())
    assert store.calls == [("mark", "a", 6), ("mark", "a", 6)]
