"""A replica's own pending claims, seen by its next decision before the Redis write lands."""

from __future__ import annotations

from router.routing.pending import LocalPending

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
