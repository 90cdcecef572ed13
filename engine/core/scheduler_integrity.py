"""The scheduler's integrity check (tests and soak runs call it after every step).

Invariants it asserts: every request is in exactly one of waiting, running or swapped, and
in `requests`; waiting and swapped are sorted by `sort_key`; the swap space holds records
for exactly the swapped requests; the KV manager's own checks hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request


def check_scheduler(kv: KVCacheManager, requests: Mapping[str, Request],
                    waiting: Sequence[Request], running: Sequence[Request],
                    swapped: Sequence[Request]) -> None:
    kv.check_integrity()
    ids = [r.request_id for r in [*waiting, *running, *swapped]]
    if len(ids) != len(set(ids)) or set(ids) != set(requests):
        raise AssertionError("a request is lost or queued twice")
    for queue in (waiting, swapped):
        if [r.sort_key for r in queue] != sorted(r.sort_key for r in queue):
            raise AssertionError("waiting or swapped queue is out of order")
    swap_records = set() if kv.swap is None else set(kv.swap.records)
    if swap_records != {r.request_id for r in swapped}:
        raise AssertionError("swap records disagree with the swapped queue")
