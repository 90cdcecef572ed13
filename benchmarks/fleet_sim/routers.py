"""The routing policies the simulator compares: the router's own code, and an oracle.

Role: `RouterReplica` is one router replica as `router.engines.dispatch` drives it, minus the
gRPC: `EngineSelector.decide` (the real decision: block hashing, the Lua lookup on the real
Redis, ranking, pending claims), then `PendingClaims.claim` on the chosen engine and the
pool's in-flight / prefilling counts (`EnginePool.begin`, `prefilled`, `end`), as dispatch
does. `Oracle` ranks with the same cost model (`router.routing.ranking.rank_prefix`) fed with
every engine's *true* state at the decision's instant: its cache, the blocks its queued
requests will compute (exact "pending"), its queue and its calibrated rates.

Invariants:
- Decisions are serialised: the simulator awaits each one, and every background write it
  started (pending claims), before the virtual clock moves (deterministic per seed, apart
  from wall-clock expiry of Redis-side pending entries; see `PendingExpiry`).
- Only the decision call is timed (`decision_s`): hashing, the Redis round trip, the ranking.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

import redis

from benchmarks.fleet_sim.engine_model import SimEngine, SimRequest
from benchmarks.fleet_sim.publisher import SimPublisher
from kvfleet.contracts import redis_schema
from router.engines.pool import EnginePool
from router.routing import pending
from router.routing.decision import EngineSelector, RoutingConfig
from router.routing.prefix_index import PrefixIndex, PrefixIndexConfig
from router.routing.ranking import (
    EngineView,
    Policy,
    PrefixPolicyConfig,
    RequestShape,
    rank_prefix,
)

Clock = Callable[[], float]


class PendingExpiry:
    """Removes routers' pending entries when they expire in *virtual* time.

    Redis expires them by its wall clock (`TIME`), which the simulation outruns: without
    this, a claim meant to count for 3 simulated seconds would count for many more.
    """

    def __init__(self, redis_url: str) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self._heap: list[tuple[float, int, str, str, list[bytes]]] = []
        self._latest: dict[tuple[str, str, bytes], float] = {}
        self._seq = 0

    def add(self, engine_id: str, epoch: str, hashes: Sequence[bytes], expires: float) -> None:
        for h in hashes:
            key = (engine_id, epoch, h)
            self._latest[key] = max(self._latest.get(key, 0.0), expires)
        self._seq += 1
        heapq.heappush(self._heap, (expires, self._seq, engine_id, epoch, list(hashes)))

    def expire(self, now: float) -> None:
        pipe = self._client.pipeline(transaction=False)
        while self._heap and self._heap[0][0] <= now:
            expires, _, engine_id, epoch, hashes = heapq.heappop(self._heap)
            gone = [h for h in hashes if self._latest.get((engine_id, epoch, h)) == expires]
            for h in gone:
                del self._latest[(engine_id, epoch, h)]
            if gone:
                pipe.zrem(redis_schema.pending_key(engine_id, epoch), *gone)
        pipe.execute()

    def close(self) -> None:
        self._client.close()


class SimPrefixIndex(PrefixIndex):
    """The real index; its pending claims are also registered for virtual-time expiry."""

    def __init__(self, redis_url: str, clock: Clock, expiry: PendingExpiry,
                 config: PrefixIndexConfig | None = None) -> None:
        super().__init__(redis_url, config or PrefixIndexConfig())
        self._clock = clock
        self._expiry = expiry

    async def mark_pending(
        self, engine_id: str, epoch: str, hashes: Sequence[bytes], ttl_s: float
    ) -> None:
        await super().mark_pending(engine_id, epoch, hashes, ttl_s)
        ttl = min(max(ttl_s, 0.001), redis_schema.PENDING_MAX_TTL_S)
        self._expiry.add(engine_id, epoch, hashes, self._clock() + ttl)


class RouterReplica:
    def __init__(self, policy: Policy, redis_url: str, clock: Clock, expiry: PendingExpiry,
                 prefix: PrefixPolicyConfig, index: PrefixIndexConfig | None = None) -> None:
        self.index = SimPrefixIndex(redis_url, clock, expiry, index)
        self.pool = EnginePool(clock=clock)
        self.selector = EngineSelector(RoutingConfig(policy=policy, prefix=prefix), self.index,
                                       self.pool, clock=clock)

    async def route(self, request: SimRequest) -> tuple[str, int, float, float]:
        """(engine id, uncached prompt tokens it was charged, wall and router CPU seconds
        the decision took)."""
        cpu_started, started = time.process_time(), time.perf_counter()
        decision = await self.selector.decide(request.prompt, request.tenant)
        took, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        view = decision.ranking[0]
        tokens = 0
        if decision.claims is not None:
            decision.claims.claim(view)
            tokens = decision.claims.uncached_tokens(view.engine_id)
        self.pool.begin(view.engine_id, tokens)
        await pending.drain()
        return view.engine_id, tokens, took, cpu

    def first_token(self, engine_id: str, tokens: int) -> None:
        self.pool.prefilled(engine_id, tokens)

    def finished(self, engine_id: str) -> None:
        self.pool.end(engine_id)

    async def close(self) -> None:
        await self.index.close()


class Oracle:
    """The router's cost model on the true state of every engine (module docstring)."""

    def __init__(self, engines: Sequence[SimEngine], publisher: SimPublisher,
                 prefix: PrefixPolicyConfig) -> None:
        self._engines = list(engines)
        self._publisher = publisher
        self._prefix = prefix

    def route(self, request: SimRequest, tie_key: bytes) -> str:
        views = [self._view(e, request) for e in self._engines]
        shape = RequestShape(request.prompt_len, self._engines[0].cal.block_size)
        return rank_prefix(views, tie_key, self._prefix, shape)[0].engine_id

    def _view(self, engine: SimEngine, request: SimRequest) -> EngineView:
        cal = engine.cal
        limit = (request.prompt_len - 1) // cal.block_size
        matched = engine.cache.match(request.hashes, limit)
        coming = _blocks_being_computed(engine)
        pending_run = 0
        for h in request.hashes[matched:limit]:
            if h not in coming:
                break
            pending_run += 1
        load = self._publisher.load(engine)
        return EngineView(
            engine_id=engine.engine_id, address="oracle", matched_blocks=matched,
            matched_pending_blocks=pending_run, num_running=load.num_running,
            num_waiting=load.num_waiting, kv_cache_usage=load.kv_cache_usage,
            queued_prefill_tokens=load.queued_prefill_tokens, num_decoding=load.num_decoding,
            prefill_tokens_per_s=1.0 / max(cal.prefill_s_per_token, 1e-9),
            decode_s_per_seq=cal.decode_s_per_seq,
        )


def _blocks_being_computed(engine: SimEngine) -> set[bytes]:
    bs = engine.cal.block_size
    coming: set[bytes] = set()
    for r in [*engine.running, *engine.waiting]:
        if r.computed < r.prompt_len:
            coming.update(r.hashes[r.computed // bs:])
    return coming
