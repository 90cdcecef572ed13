"""One routing decision: prompt ids + tenant -> engines ranked best-first.

Role: glue between the block hash (`engine.block_hash`, the engine's own function), the
Redis lookup (`router.prefix_index`), this replica's pool (`router.engine_pool`) and the pure
policies (`router.policy`).

Invariants:
- Hashes cover the full blocks of all prompt tokens but the last (an engine always computes
  the last prompt token to get logits, so a block ending there is never a usable hit), salted
  with the tenant, LoRA-free: exactly what the engine computes for the request we send.
- One Redis round trip per decision; a second one only when the block size hint was wrong
  (the hint is then corrected from the registry, so it happens once per change).
- Redis down: the last engine list is asked for its load over gRPC and ranked by load
  (round_robin stays round robin); Redis is retried after `redis_retry_s`, not per request.
- Suspect engines go last; an engine's `model` must equal the request's, when one is given.
- No live engine -> UnavailableError; an unknown model -> ValueError naming the served ones.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.block_hash import hash_token_blocks
from kvfleet.errors import NotFoundError, UnavailableError
from router.engine_pool import EnginePool
from router.metrics import RouterMetrics
from router.policy import EngineView, Policy, PrefixPolicyConfig, rank
from router.prefix_index import EngineRecord, PrefixIndex, PrefixIndexUnavailable

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class RoutingConfig:
    policy: Policy = Policy.PREFIX
    prefix: PrefixPolicyConfig = field(default_factory=PrefixPolicyConfig)
    # After a Redis failure, route by load alone for this long before trying Redis again.
    redis_retry_s: float = 1.0
    # Per-engine GetLoad deadline while Redis is down.
    load_timeout_s: float = 0.5


@dataclass(frozen=True)
class Decision:
    ranking: list[EngineView]
    block_size: int
    # False when Redis could not answer and the decision used load alone.
    used_index: bool
    # The policy that actually ranked (prefix falls back to least_load without Redis).
    policy: Policy = Policy.PREFIX


class EngineSelector:
    """Ranks engines for a prompt; owns the Redis reader, not the channels."""

    def __init__(
        self,
        config: RoutingConfig,
        index: PrefixIndex | None,
        pool: EnginePool,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self._index = index
        self._pool = pool
        self._block_size = DEFAULT_BLOCK_SIZE  # a hint, corrected from the registry
        self._counter = itertools.count()
        self._redis_down_until = 0.0

    async def decide(self, prompt_ids: Sequence[int], tenant: str, model: str = "") -> Decision:
        views: list[EngineView] | None = None
        if self._index is not None and time.monotonic() >= self._redis_down_until:
            views = await self._views_from_index(prompt_ids, tenant, model)
        used_index = views is not None
        if views is None:
            views = await self._pool.fetch_loads(self.config.load_timeout_s)
        self.metrics.observe_loads(views)
        if not views:
            raise UnavailableError("no live engine to serve the request")
        policy = self.config.policy
        if not used_index and policy is Policy.PREFIX:
            policy = Policy.LEAST_LOAD
        ranking = rank(
            policy,
            views,
            tie_key=_tie_key(prompt_ids, tenant),
            counter=next(self._counter),
            config=self.config.prefix,
        )
        # Engines that just failed are tried last, not never (they may have recovered).
        ranking.sort(key=lambda v: self._pool.is_suspect(v.engine_id, v.address))
        return Decision(ranking, self._block_size, used_index, policy)

    async def served_models(self) -> list[str]:
        """Model names of the live engines (empty when Redis cannot answer)."""
        if self._index is None:
            return []
        try:
            records = await self._index.lookup(self._block_size, [])
        except PrefixIndexUnavailable:
            return []
        return sorted({r.model for r in records if r.model})

    async def _views_from_index(
        self, prompt_ids: Sequence[int], tenant: str, model: str
    ) -> list[EngineView] | None:
        assert self._index is not None
        started = time.perf_counter()
        try:
            records = await self._lookup(prompt_ids, tenant)
        except PrefixIndexUnavailable as e:
            self.metrics.redis_errors.inc()
            logger.warning("prefix index unavailable (%s); routing by load for %.1fs",
                           e, self.config.redis_retry_s)
            self._redis_down_until = time.monotonic() + self.config.redis_retry_s
            return None
        self.metrics.redis_latency.observe(time.perf_counter() - started)
        self._pool.remember({r.engine_id: r.address for r in records if r.address})
        return self._to_views(_for_model(records, model))

    async def _lookup(self, prompt_ids: Sequence[int], tenant: str) -> list[EngineRecord]:
        assert self._index is not None
        records = await self._index.lookup(self._block_size, self._hashes(prompt_ids, tenant))
        sizes = collections.Counter(r.block_size for r in records if r.block_size)
        if sizes and self._block_size not in sizes:
            # Engines advertise their block size; adopt the most common one and ask again.
            self._block_size = sizes.most_common(1)[0][0]
            logger.info("engines use block size %d; re-hashing", self._block_size)
            records = await self._index.lookup(
                self._block_size, self._hashes(prompt_ids, tenant)
            )
        return records

    def _hashes(self, prompt_ids: Sequence[int], tenant: str) -> list[bytes]:
        if self.config.policy is not Policy.PREFIX:
            return []  # other policies only need the registry and load
        return hash_token_blocks(prompt_ids[:-1], self._block_size, cache_salt=tenant)

    def _to_views(self, records: Sequence[EngineRecord]) -> list[EngineView]:
        return [
            EngineView(
                engine_id=r.engine_id,
                address=r.address,
                matched_blocks=r.matched_blocks,
                num_running=r.int_field("num_running"),
                num_waiting=r.int_field("num_waiting"),
                kv_cache_usage=r.float_field("kv_cache_usage"),
                in_flight=self._pool.in_flight(r.engine_id),
            )
            for r in records
            if r.address
        ]


def _for_model(records: Sequence[EngineRecord], model: str) -> list[EngineRecord]:
    if not model:
        return list(records)
    matching = [r for r in records if r.model == model]
    if records and not matching:
        served = sorted({r.model for r in records if r.model})
        raise NotFoundError(
            f"The model `{model}` does not exist; served: {', '.join(served)}"
        )
    return matching


def _tie_key(prompt_ids: Sequence[int], tenant: str) -> bytes:
    """Stable per (tenant, prompt start): replicas break ties the same way for a prefix."""
    head = ",".join(map(str, prompt_ids[:DEFAULT_BLOCK_SIZE]))
    return hashlib.blake2b(f"{tenant}\x00{head}".encode(), digest_size=8).digest()
