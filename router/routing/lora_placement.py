"""Loading a LoRA adapter on one more engine when every engine serving it is saturated.

An engine is *saturated* when it has no free sequence slot: its load (`EngineView.load`:
running + waiting as published, or this router's own in-flight streams when higher) has
reached its `max_num_seqs`. A request sent there would queue behind the others. When every
engine serving a request's adapter is saturated, and a live engine of the same base model
with LoRA enabled (published `max_loras` > 0) does not serve it and is not saturated, the
router loads the adapter there (the engine's LoadLoRAAdapter, as `/v1/load_lora_adapter`
does, from the directory the holders published in `lora_paths`) and sends the request there;
the holders follow in the ranking for retries.

`choose_load_target` is the pure decision (exact choices, unit-tested); `LoRAPlacer` runs the
loads for a router replica.

Invariants:
- At most one load in flight per adapter in this replica (hence per (engine, adapter)):
  requests arriving while it runs await the same load (without blocking the event loop) and
  then go to that engine; they never start a second one. A client that goes away does not
  cancel a load others wait for.
- A failed load (refused, unreachable, timed out) sends the request to the holders as if no
  load had been tried, and that engine is not asked for that adapter again for
  `retry_after_failure_s`.
- An engine this replica just loaded the adapter on counts as serving it until its registry
  entry says so (at most `publish_grace_s`; the engine publishes within a heartbeat).
- Engines whose registry lacks `max_num_seqs` count as never saturated, and engines lacking
  `max_loras` as unable to take an adapter: nothing is loaded on their account.
- Replicas decide alone; ties go by a hash of (adapter, engine id), so replicas seeing the
  same loads pick the same engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvfleet.contracts.adapter_paths import AdapterRoots
from kvfleet.v1 import engine_pb2
from router.engines.pool import EnginePool
from router.metrics import RouterMetrics
from router.routing.ranking import EngineView, rendezvous_weight

logger = logging.getLogger(__name__)

# Reads the adapter from disk on the engine; requests for the adapter wait this long at most.
DEFAULT_LOAD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class LoRAPlacementConfig:
    # False: never load an adapter on the router's own initiative (--no-lora-autoload).
    enabled: bool = True
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    retry_after_failure_s: float = 30.0
    publish_grace_s: float = 5.0


def is_saturated(engine: EngineView) -> bool:
    """No free sequence slot (module docstring); an unknown max_num_seqs never is."""
    return engine.max_num_seqs > 0 and engine.load >= engine.max_num_seqs


def choose_load_target(
    adapter: str, holders: Sequence[EngineView], candidates: Sequence[EngineView]
) -> EngineView | None:
    """The engine to load `adapter` on, or None to stay with the holders.

    `holders` serve the adapter; `candidates` could take it (same base model, LoRA enabled,
    not suspect, not recently failed). Only when there are holders and all are saturated is
    a candidate chosen: the least loaded unsaturated one, then the lowest KV usage, then the
    highest rendezvous weight of (adapter, engine id).
    """
    if not holders or not all(is_saturated(h) for h in holders):
        return None
    free = [c for c in candidates if c.max_num_seqs > 0 and not is_saturated(c)]
    if not free:
        return None
    key = adapter.encode()
    return min(free, key=lambda c: (c.load, c.kv_cache_usage, -rendezvous_weight(key, c.engine_id)))


LoadAdapter = Callable[[EngineView, str, str], Awaitable[object]]


def engine_loader(
    pool: EnginePool, timeout_s: float, roots: AdapterRoots | None = None
) -> LoadAdapter:
    """Calls LoadLoRAAdapter(name, path) on an engine with the router credential; a path
    outside `roots` (--lora-allowed-dirs: Redis entries are not trusted) is a failed load."""

    async def load(engine: EngineView, name: str, path: str) -> object:
        if roots is not None:
            path = roots.check_inside(path)
        stub = pool.stub(engine.engine_id, engine.address)
        request = engine_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        return await stub.LoadLoRAAdapter(request, metadata=pool.credential, timeout=timeout_s)

    return load


class LoRAPlacer:
    """One replica's adapter loads: in flight, recently done, recently failed."""

    def __init__(
        self,
        config: LoRAPlacementConfig,
        load: LoadAdapter,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._load = load
        self._metrics = metrics
        self._clock = clock
        self._pending: dict[str, asyncio.Future[EngineView | None]] = {}  # adapter -> load
        self._loaded: dict[tuple[str, str], float] = {}  # (engine id, adapter) -> when
        self._failed_until: dict[tuple[str, str], float] = {}

    def holds(self, engine_id: str, adapter: str) -> bool:
        """True while a load this replica made is not yet in the engine's registry entry."""
        at = self._loaded.get((engine_id, adapter))
        return at is not None and self._clock() - at <= self.config.publish_grace_s

    def forget(self, adapter: str) -> None:
        """The adapter was unloaded (router API): drop what this replica remembers of it."""
        for table in (self._loaded, self._failed_until):
            for key in [k for k in table if k[1] == adapter]:
                del table[key]

    async def target(
        self, adapter: str, path: str, holders: Sequence[EngineView],
        candidates: Sequence[EngineView],
    ) -> EngineView | None:  # fmt: skip
        """The engine to send the request to once the adapter is loaded there, or None."""
        if not self.config.enabled or not path:
            return None
        pending = self._pending.get(adapter)
        if pending is None:
            now = self._clock()
            allowed = [
                c for c in candidates if self._failed_until.get((c.engine_id, adapter), 0.0) <= now
            ]
            choice = choose_load_target(adapter, holders, allowed)
            if choice is None:
                return None
            pending = self._start(adapter, path, choice)
        elif not all(is_saturated(h) for h in holders):
            return None  # a holder has room again: no need to wait for the load
        # Shielded: a cancelled request must not cancel the load other requests await.
        return await asyncio.shield(pending)

    def _start(
        self, adapter: str, path: str, engine: EngineView
    ) -> asyncio.Future[EngineView | None]:
        logger.info(
            "every engine serving LoRA adapter %r is saturated: loading it on %s",
            adapter,
            engine.engine_id,
        )
        task = asyncio.ensure_future(self._run(adapter, path, engine))
        self._pending[adapter] = task
        task.add_done_callback(lambda _: self._pending.pop(adapter, None))
        return task

    async def _run(self, adapter: str, path: str, engine: EngineView) -> EngineView | None:
        key = (engine.engine_id, adapter)
        try:
            await self._load(engine, adapter, path)
        except Exception as exc:  # any failure: the holders serve the request
            self._failed_until[key] = self._clock() + self.config.retry_after_failure_s
            self._count(engine.engine_id, "failed")
            logger.warning(
                "could not load LoRA adapter %r on %s (%s); not retried there for %.0fs",
                adapter,
                engine.engine_id,
                _describe(exc),
                self.config.retry_after_failure_s,
            )
            return None
        now = self._clock()
        for stale in [
            k for k, at in self._loaded.items() if now - at > self.config.publish_grace_s
        ]:
            del self._loaded[stale]
        self._loaded[key] = now
        self._count(engine.engine_id, "loaded")
        return engine

    def _count(self, engine_id: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.lora_adapter_loads.labels(engine_id, outcome).inc()


def _describe(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    if callable(details):  # a gRPC error: its status message says what went wrong
        return str(details() or exc)
    return str(exc) or type(exc).__name__
