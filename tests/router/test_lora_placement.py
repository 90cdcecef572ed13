"""Loading a LoRA adapter on another engine when its holders are saturated
(router/routing/lora_placement.py): the pure choice with exact expected engines, then the placer's
concurrency, failure and bookkeeping rules with an in-process loader (the real RPC and fleet
are in tests/fleet/test_lora_fleet.py)."""

from __future__ import annotations

import asyncio

import pytest

from router.metrics import RouterMetrics
from router.routing.lora_placement import (
    LoRAPlacementConfig,
    LoRAPlacer,
    choose_load_target,
    is_saturated,
)
from router.routing.ranking import EngineView, rendezvous_weight

ADAPTER = "sql"
PATH = "/adapters/sql"


def view(engine_id: str, running: int = 0, waiting: int = 0, max_num_seqs: int = 4,
         in_flight: int = 0, usage: float = 0.0) -> EngineView:  # fmt: skip
    return EngineView(
        engine_id, f"{engine_id}:1", num_running=running, num_waiting=waiting,
        kv_cache_usage=usage, in_flight=in_flight, max_num_seqs=max_num_seqs,
    )  # fmt: skip


FULL = view("holder", running=3, waiting=1)  # 4 of 4 slots taken


def test_saturated_means_no_free_sequence_slot() -> None:
    assert not is_saturated(view("a", running=3))
    assert is_saturated(view("a", running=4))
    assert is_saturated(view("a", running=2, waiting=5))
    assert is_saturated(view("a", in_flight=4))  # this router's own streams count too
    assert not is_saturated(view("a", running=100, max_num_seqs=0))  # unknown: never


def test_no_load_while_a_holder_has_room() -> None:
    candidates = [view("b")]
    assert choose_load_target(ADAPTER, [FULL, view("h2", running=3)], candidates) is None
    assert choose_load_target(ADAPTER, [], candidates) is None
    assert choose_load_target(ADAPTER, [view("old", running=9, max_num_seqs=0)],
                              candidates) is None  # fmt: skip


def test_least_loaded_free_candidate_wins() -> None:
    candidates = [view("b", running=3), view("c", running=1), view("d", running=4),
                  view("e", running=0, max_num_seqs=0)]  # fmt: skip
    # d is saturated itself; e does not say how many sequences it runs.
    choice = choose_load_target(ADAPTER, [FULL, view("h2", waiting=4)], candidates)
    assert choice is not None and choice.engine_id == "c"
    assert choose_load_target(ADAPTER, [FULL], [view("d", running=4)]) is None


def test_ties_go_to_kv_usage_then_the_adapter_hash() -> None:
    choice = choose_load_target(ADAPTER, [FULL], [view("b", usage=0.5), view("c", usage=0.2)])
    assert choice is not None and choice.engine_id == "c"
    expected = max("bcd", key=lambda e: rendezvous_weight(ADAPTER.encode(), e))
    choice = choose_load_target(ADAPTER, [FULL], [view(e) for e in "bcd"])
    assert choice is not None and choice.engine_id == expected


class Loader:
    """Records calls; each load waits for `release` and fails when `fail` is set."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.release = asyncio.Event()
        self.fail = fail

    async def __call__(self, engine: EngineView, name: str, path: str) -> object:
        self.calls.append((engine.engine_id, name, path))
        await self.release.wait()
        if self.fail:
            raise RuntimeError("engine refused")
        return None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def placer(loader: Loader, clock: Clock | None = None, metrics: RouterMetrics | None = None,
           **config: object) -> LoRAPlacer:  # fmt: skip
    return LoRAPlacer(LoRAPlacementConfig(**config), loader, metrics,  # type: ignore[arg-type]
                      clock or Clock())  # fmt: skip


def loads(metrics: RouterMetrics, engine_id: str, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvfleet:router_lora_adapter_loads_total", {"engine_id": engine_id, "outcome": outcome}
    )
    return value or 0.0


async def until_called(loader: Loader, count: int = 1) -> None:
    while len(loader.calls) < count:
        await asyncio.sleep(0)


def test_concurrent_requests_share_one_load() -> None:
    async def scenario() -> tuple[list[EngineView | None], Loader, RouterMetrics, LoRAPlacer]:
        loader, metrics = Loader(), RouterMetrics()
        p = placer(loader, metrics=metrics)
        waiters = [asyncio.ensure_future(p.target(ADAPTER, PATH, [FULL], [view("b"), view("c")]))
                   for _ in range(5)]  # fmt: skip
        await until_called(loader)
        loader.release.set()
        return await asyncio.gather(*waiters), loader, metrics, p

    results, loader, metrics, p = asyncio.run(scenario())
    expected = max("bc", key=lambda e: rendezvous_weight(ADAPTER.encode(), e))
    assert [r.engine_id if r else None for r in results] == [expected] * 5
    assert loader.calls == [(expected, ADAPTER, PATH)]
    assert loads(metrics, expected, "loaded") == 1
    assert p.holds(expected, ADAPTER) and not p.holds(expected, "other")


def test_a_failed_load_falls_back_and_is_not_retried_at_once() -> None:
    clock, metrics = Clock(), RouterMetrics()

    async def scenario() -> list[EngineView | None]:
        loader = Loader(fail=True)
        loader.release.set()
        p = placer(loader, clock, metrics, retry_after_failure_s=30.0)
        first = await p.target(ADAPTER, PATH, [FULL], [view("b")])
        again = await p.target(ADAPTER, PATH, [FULL], [view("b")])  # b is still excluded
        other = await p.target(ADAPTER, PATH, [FULL], [view("b"), view("c")])
        clock.now += 31.0
        loader.fail = False
        later = await p.target(ADAPTER, PATH, [FULL], [view("b")])
        assert loader.calls == [("b", ADAPTER, PATH), ("c", ADAPTER, PATH), ("b", ADAPTER, PATH)]
        return [first, again, other, later]

    results = asyncio.run(scenario())
    assert [r.engine_id if r else None for r in results] == [None, None, None, "b"]
    assert loads(metrics, "b", "failed") == 1 and loads(metrics, "c", "failed") == 1
    assert loads(metrics, "b", "loaded") == 1


def test_a_cancelled_request_does_not_cancel_the_load() -> None:
    async def scenario() -> EngineView | None:
        loader = Loader()
        p = placer(loader)
        first = asyncio.ensure_future(p.target(ADAPTER, PATH, [FULL], [view("b")]))
        await until_called(loader)
        first.cancel()
        second = asyncio.ensure_future(p.target(ADAPTER, PATH, [FULL], [view("b")]))
        await asyncio.sleep(0)
        loader.release.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(loader.calls) == 1
        return await second

    result = asyncio.run(scenario())
    assert result is not None and result.engine_id == "b"


def test_no_wait_for_a_load_once_a_holder_has_room() -> None:
    async def scenario() -> EngineView | None:
        loader = Loader()
        p = placer(loader)
        first = asyncio.ensure_future(p.target(ADAPTER, PATH, [FULL], [view("b")]))
        await until_called(loader)
        roomy = await p.target(ADAPTER, PATH, [view("holder", running=1)], [view("b")])
        loader.release.set()
        await first
        return roomy

    assert asyncio.run(scenario()) is None


def test_disabled_or_without_a_path_nothing_is_loaded() -> None:
    async def scenario() -> list[EngineView | None]:
        loader = Loader()
        loader.release.set()
        off = placer(loader, enabled=False)
        on = placer(loader)
        results = [await off.target(ADAPTER, PATH, [FULL], [view("b")]),
                   await on.target(ADAPTER, "", [FULL], [view("b")])]  # fmt: skip
        assert loader.calls == []
        return results

    assert asyncio.run(scenario()) == [None, None]


def test_a_load_counts_as_serving_until_the_grace_ends_or_it_is_forgotten() -> None:
    clock = Clock()

    async def scenario() -> LoRAPlacer:
        loader = Loader()
        loader.release.set()
        p = placer(loader, clock, publish_grace_s=5.0)
        await p.target(ADAPTER, PATH, [FULL], [view("b")])
        await p.target("other", "/adapters/other", [FULL], [view("b")])
        return p

    p = asyncio.run(scenario())
    assert p.holds("b", ADAPTER) and p.holds("b", "other")
    p.forget(ADAPTER)
    assert not p.holds("b", ADAPTER) and p.holds("b", "other")
    clock.now += 6.0
    assert not p.holds("b", "other")
