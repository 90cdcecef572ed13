"""One routing decision: prompt ids + tenant -> engines ranked best-first.

Role: glue between the block hash (`kvfleet.contracts.block_hash`, the engine's own function), the
Redis lookup (`router.routing.prefix_index`), engine discovery without Redis
(`router.engines.discovery`), this replica's pool (`router.engines.pool`) and the pure
policies (`router.routing.ranking`).

Invariants:
- Hashes cover the full blocks of all prompt tokens but the last (an engine always computes
  the last prompt token to get logits, so a block ending there is never a usable hit), salted
  with the tenant, and with the adapter when the model names a LoRA adapter this router has
  seen published (`router.routing.lora_engines`): exactly what the engine computes for the request.
- One Redis round trip per decision; a second one only when the block size hint was wrong
  (the hint is then corrected from the registry, so it happens once per change), or when a
  large fleet's candidate answer (`router.routing.prefix_index`: holders of the prompt's first
  block plus the least loaded engines) cannot serve the request as the whole fleet could --
  no candidate serves the model or adapter, or the fleet splits prefill and decode -- and the
  whole fleet is read instead. A candidate answer updates the engines this replica knows
  without forgetting the others.
- A prefix decision made with the index carries its prompt hashes as `PendingClaims`,
  marked pending in the background (`router.routing.pending`; the decision's own latency
  stays one round trip) on its first engine at once, and on any other engine the dispatcher
  sends the request to after a failure. This replica's own claims count for its next
  decisions at once, before their writes land. The decision also holds the engine the
  request is sent to first (`decide`'s `first`: a prefill engine in a disaggregated fleet;
  `PendingClaims.reserve`): until the request is sent there (or given up), this replica's
  next decisions count it in flight and prefilling on that engine, so a burst decided
  before any of it is sent spreads as if sent one by one.
- Each decision names why its first engine won (`Decision.reason`) and predicts the cached
  tokens of any engine it ranked (`Decision.predicted_cached_tokens`), for the metrics and
  the request's span.
- Redis unreachable (or not configured): the engines are found at the last addresses Redis
  gave plus the static list / DNS name (`--engines`, `--engine-dns`), asked for their load,
  id and model over gRPC, and ranked by load (round_robin stays round robin); Redis is
  retried after `redis_retry_s`, not per request, and the outage is logged once.
- Redis answering with no engine registered (it restarted empty; engines re-register within a
  heartbeat) is treated like Redis unreachable for that decision: the known and discoverable
  engines are polled, so a Redis restart does not turn into a burst of UNAVAILABLE.
- Redis busy (every connection of this router in use for the pool timeout): Redis is not
  marked down; that one decision ranks the engines of the last answer by their last load
  and this router's in-flight counts, without polling anyone.
- The model filter applies whichever way the engines were found: an engine's `model` must
  equal the request's, when one is given. Suspect engines go last.
  A model naming a LoRA adapter selects the engines serving it, and the decision carries it
  as `lora_id` for the engine request. When every one of them is saturated, the adapter is
  loaded on another engine first and the request goes there (`router.routing.lora_placement`; the
  decision then waits for that load, without blocking other requests).
- No live engine -> UnavailableError; an unknown model -> NotFoundError naming the served ones.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.contracts.errors import NotFoundError, UnavailableError
from router.engines.discovery import EngineDiscovery
from router.engines.pool import EnginePool
from router.metrics import RouterMetrics
from router.routing.engine_view import UNKNOWN
from router.routing.lora_engines import (
    adapter_for,
    adapter_path,
    adapters_of,
    served_adapters,
    takes_adapters,
)
from router.routing.lora_placement import LoRAPlacer, is_saturated
from router.routing.pending import LocalPending, PendingClaims, PendingConfig, Reservations
from router.routing.prefix_index import (
    EngineRecord,
    PrefixIndex,
    PrefixIndexBusy,
    PrefixIndexUnavailable,
)
from router.routing.ranking import (
    EngineView,
    Policy,
    PrefixPolicyConfig,
    RequestShape,
    choice_reason,
    rank,
)
from router.routing.ttft_cost import estimate_all

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
# (ranking, the decision's LoRA adapter) -> the engine the request is sent to first.
FirstEngine = Callable[[Sequence[EngineView], str], EngineView | None]
# At most one "Redis connections busy" warning per this many seconds.
BUSY_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class RoutingConfig:
    policy: Policy = Policy.PREFIX
    prefix: PrefixPolicyConfig = field(default_factory=PrefixPolicyConfig)
    # After a Redis failure, route by load alone for this long before trying Redis again.
    redis_retry_s: float = 1.0
    # Per-engine GetLoad deadline while Redis is down; a slower engine keeps its last load.
    load_timeout_s: float = 0.5
    # How long the blocks of a request just sent count as the engine's (router.routing.pending).
    pending: PendingConfig = field(default_factory=PendingConfig)


@dataclass(frozen=True)
class Decision:
    ranking: list[EngineView]
    block_size: int
    # False when Redis could not answer and the decision used load alone.
    used_index: bool
    # The policy that actually ranked (prefix falls back to least_load without Redis).
    policy: Policy = Policy.PREFIX
    # The LoRA adapter the model names ("" for a base model); engines get it as lora_id.
    lora_id: str = ""
    # Why ranking[0] won (router.routing.ranking.choice_reason; "lora_placement" when the
    # adapter was just loaded there).
    reason: str = ""
    # The prompt's blocks, to mark pending on the engine the request is sent to (None:
    # nothing to mark, e.g. without the prefix index).
    claims: PendingClaims | None = None
    prompt_tokens: int = 0

    def reason_for(self, engine_id: str) -> str:
        """Why the request went to `engine_id`: the decision's reason, or "retry"."""
        first = self.ranking[0].engine_id if self.ranking else ""
        return self.reason if engine_id == first else "retry"

    def predicted_cached_tokens(self, engine: EngineView) -> int:
        """Prompt tokens the engine should report cached: held (device or host) or pending."""
        blocks = engine.matched_blocks + engine.matched_host_blocks + engine.matched_pending_blocks
        return max(min(blocks * self.block_size, self.prompt_tokens - 1), 0)


class EngineSelector:
    """Ranks engines for a prompt; owns the Redis reader, not the channels."""

    def __init__(
        self,
        config: RoutingConfig,
        index: PrefixIndex | None,
        pool: EnginePool,
        metrics: RouterMetrics | None = None,
        discovery: EngineDiscovery | None = None,
        placer: LoRAPlacer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.placer = placer
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self._index = index
        self._pool = pool
        self._discovery = discovery
        self._block_size = DEFAULT_BLOCK_SIZE  # a hint, corrected from the registry
        self._counter = itertools.count()
        self._redis_down_until = 0.0
        self._redis_ok = True
        self._busy_logged_at = -BUSY_LOG_EVERY_S
        # Adapter names seen in the last answers: their prompts are hashed with the adapter.
        self._adapters: set[str] = set()
        # This replica's own claims, before their Redis writes land (router.routing.pending).
        # `clock`: when they expire (the fleet simulator's virtual clock, benchmarks/fleet_sim).
        self._local_pending = LocalPending(clock)
        # Decisions not sent yet, counted as in flight on their first engine (pending.py).
        self._reservations = Reservations(clock)

    async def decide(
        self, prompt_ids: Sequence[int], tenant: str, model: str = "",
        first: FirstEngine | None = None,
    ) -> Decision:
        """Engines ranked for the prompt. `first(ranking, lora_id)`: the engine the request
        will be sent to first, which the decision holds (`PendingClaims.reserve`); by
        default the first engine when it takes whole requests (role both), else none."""
        lora_hint = model if model in self._adapters else ""
        tie_key = _tie_key(prompt_ids, tenant)
        records, used_index, hashes = await self._records(prompt_ids, tenant, lora_hint, model,
                                                          tie_key)
        lora_id = adapter_for(records, model)
        if lora_id:
            self._adapters.add(lora_id)
            if lora_id != lora_hint:
                used_index = False  # hashed without the adapter: its matches mean nothing
        serving = self._serving(records, lora_id) if lora_id else _for_model(records, model)
        views = self._to_views(serving)
        if used_index and hashes:
            views = [self._with_local_claims(v, hashes) for v in views]
        self.metrics.observe_loads(views)
        if not views:
            raise UnavailableError("no live engine to serve the request")
        policy = self.config.policy
        if not used_index and policy is Policy.PREFIX:
            policy = Policy.LEAST_LOAD
        shape = RequestShape(len(prompt_ids), self._block_size)
        # Computed once for the ranking, its reason and the claims (a decision's cost grows
        # with the fleet: each pass over 128 engines is ~0.3 ms of CPU).
        estimates = (estimate_all(views, shape, self.config.prefix)
                     if policy is Policy.PREFIX else None)
        ranking = rank(
            policy,
            views,
            tie_key=tie_key,
            counter=next(self._counter),
            config=self.config.prefix,
            shape=shape,
            costs=estimates,
        )
        # Engines that just failed are tried last, not never (they may have recovered).
        ranking.sort(key=lambda v: self._pool.is_suspect(v.engine_id, v.address))
        reason = choice_reason(policy, ranking, self.config.prefix, shape, estimates)
        if lora_id and self.placer is not None and all(is_saturated(v) for v in views):
            target = await self._load_target(records, serving, lora_id, views)
            if target is not None:
                ranking = [target, *(v for v in ranking if v.engine_id != target.engine_id)]
                reason = "lora_placement"
        claims = None
        # A prompt shorter than a block has no hashes to claim, but is held all the same.
        if self._index is not None and used_index and estimates is not None:
            claims = PendingClaims(self._index, hashes, estimates, self.config.pending,
                                   self._local_pending, self._reservations)
            held = (first or _whole_first)(ranking, lora_id)
            if held is not None:
                claims.reserve(held)
        return Decision(ranking, self._block_size, used_index, policy, lora_id, reason, claims,
                        len(prompt_ids))

    def _with_local_claims(self, view: EngineView, hashes: Sequence[bytes]) -> EngineView:
        """The view with this replica's own claims continuing the run Redis reported."""
        start = view.matched_blocks + view.matched_host_blocks + view.matched_pending_blocks
        extra = self._local_pending.run(view.engine_id, view.epoch, hashes, start)
        if not extra:
            return view
        return dataclasses.replace(view, matched_pending_blocks=view.matched_pending_blocks + extra)

    def _serving(self, records: Sequence[EngineRecord], adapter: str) -> list[EngineRecord]:
        """Engines serving the adapter, by their registry entry or a load of ours just done."""
        placer = self.placer
        return [r for r in records if adapter in adapters_of(r)
                or (placer is not None and placer.holds(r.engine_id, adapter))]

    async def _load_target(
        self, records: Sequence[EngineRecord], serving: Sequence[EngineRecord], adapter: str,
        holder_views: Sequence[EngineView],
    ) -> EngineView | None:  # fmt: skip
        """An engine the adapter was just loaded on because its holders are saturated."""
        assert self.placer is not None
        held_by = {r.engine_id for r in serving}
        bases = {r.model for r in serving}
        others = [r for r in records
                  if r.engine_id not in held_by and r.model in bases and takes_adapters(r)]
        candidates = [v for v in self._to_views(others)
                      if not self._pool.is_suspect(v.engine_id, v.address)]
        path = adapter_path(serving, adapter)
        return await self.placer.target(adapter, path, holder_views, candidates)

    async def served_models(self) -> list[str]:
        """Model names of the live engines, however they were found (empty: none)."""
        records, _, _ = await self._records((), "")
        return sorted({r.model for r in records if r.model})

    async def served_adapters(self) -> dict[str, str]:
        """{LoRA adapter name: its base model} over the live engines."""
        records, _, _ = await self._records((), "")
        return served_adapters(records)

    async def live_engines(self) -> list[EngineRecord]:
        """Every live engine, however found (for fan-out calls such as adapter loading)."""
        records, _, _ = await self._records((), "")
        return [r for r in records if r.address]

    async def served_context_lens(self) -> dict[str, int]:
        """{model name: the largest max_model_len its live engines report (0: unknown)}."""
        records, _, _ = await self._records((), "")
        lens: dict[str, int] = {}
        for record in records:
            if record.model:
                lens[record.model] = max(lens.get(record.model, 0),
                                         record.int_field("max_model_len"))
        return dict(sorted(lens.items()))

    async def _records(
        self, prompt_ids: Sequence[int], tenant: str, lora_id: str = "", model: str = "",
        tie_key: bytes = b"",
    ) -> tuple[list[EngineRecord], bool, list[bytes]]:
        """The live engines, whether they came from the prefix index (module docstring), and
        the prompt's block hashes they were matched against (empty without the index)."""
        if self._index is not None and time.monotonic() >= self._redis_down_until:
            started = time.perf_counter()
            try:
                records, complete, hashes = await self._lookup(prompt_ids, tenant, lora_id,
                                                               model, tie_key)
            except PrefixIndexBusy as e:
                self._on_busy(e)
                if self._pool.known:
                    return self._pool.known, False, []
            except PrefixIndexUnavailable as e:
                self._on_unavailable(e)
            else:
                self.metrics.redis_latency.observe(time.perf_counter() - started)
                self._on_answer()
                if records:
                    if complete:
                        self._pool.remember(records)
                    return records, True, hashes
                # No engine registered: typically a Redis that just restarted empty, before
                # the engines' next heartbeat. The engines known or discoverable may serve.
        addresses = await self._discovery.addresses() if self._discovery is not None else []
        return await self._pool.poll(addresses, self.config.load_timeout_s), False, []

    def _on_answer(self) -> None:
        if not self._redis_ok:
            logger.info("prefix index reachable again")
        self._redis_ok = True

    def _on_unavailable(self, error: PrefixIndexUnavailable) -> None:
        self.metrics.redis_errors.inc()
        self._redis_down_until = time.monotonic() + self.config.redis_retry_s
        if self._redis_ok:  # once per outage, not once per request
            logger.warning("prefix index unavailable (%s); routing by load, retrying Redis "
                           "every %.1fs", error, self.config.redis_retry_s)
        self._redis_ok = False

    def _on_busy(self, error: PrefixIndexBusy) -> None:
        self.metrics.redis_pool_timeouts.inc()
        now = time.monotonic()
        if now - self._busy_logged_at >= BUSY_LOG_EVERY_S:
            self._busy_logged_at = now
            logger.warning("%s: routing such decisions by the last known load (raise "
                           "--redis-max-connections or --redis-pool-timeout?)", error)

    async def _lookup(
        self, prompt_ids: Sequence[int], tenant: str, lora_id: str = "", model: str = "",
        tie_key: bytes = b"",
    ) -> tuple[list[EngineRecord], bool, list[bytes]]:
        """The index's engines (all, or a large fleet's candidates: `complete` False), and
        the prompt's hashes. `tie_key`: the prompt's (`_tie_key`), when the caller has it."""
        assert self._index is not None
        hashes = self._hashes(prompt_ids, tenant, lora_id)
        seed = int.from_bytes((tie_key or _tie_key(prompt_ids, tenant))[:4], "little")
        answer = await self._index.lookup_answer(self._block_size, hashes, seed=seed)
        sizes = collections.Counter(r.block_size for r in answer.records if r.block_size)
        if sizes and self._block_size not in sizes:
            # Engines advertise their block size; adopt the most common one and ask again.
            self._block_size = sizes.most_common(1)[0][0]
            logger.info("engines use block size %d; re-hashing", self._block_size)
            hashes = self._hashes(prompt_ids, tenant, lora_id)
            answer = await self._index.lookup_answer(self._block_size, hashes, seed=seed)
        if not answer.complete and _needs_whole_fleet(answer.records, model):
            answer = await self._index.lookup_answer(self._block_size, hashes, full=True)
        if not answer.complete:
            self._pool.remember_some(answer.records)
        return answer.records, answer.complete, hashes

    def _hashes(self, prompt_ids: Sequence[int], tenant: str, lora_id: str = "") -> list[bytes]:
        if self.config.policy is not Policy.PREFIX:
            return []  # other policies only need the registry and load
        return hash_token_blocks(
            prompt_ids[:-1], self._block_size, cache_salt=tenant, lora_id=lora_id or None
        )

    def _to_views(self, records: Sequence[EngineRecord]) -> list[EngineView]:
        return [self._with_reserved(v) for v in self._pool_views(records)]

    def _with_reserved(self, view: EngineView) -> EngineView:
        """The view with the requests decided for it and not sent yet (pending.py)."""
        count, tokens = self._reservations.held(view.engine_id)
        if not count:
            return view
        return dataclasses.replace(view, in_flight=view.in_flight + count,
                                   own_prefilling=view.own_prefilling + count,
                                   own_prefill_tokens=view.own_prefill_tokens + tokens)

    def _pool_views(self, records: Sequence[EngineRecord]) -> list[EngineView]:
        return [
            EngineView(
                engine_id=r.engine_id,
                address=r.address,
                matched_blocks=r.matched_blocks,
                matched_host_blocks=r.matched_host_blocks,
                num_running=r.int_field("num_running"),
                num_waiting=r.int_field("num_waiting"),
                kv_cache_usage=r.float_field("kv_cache_usage"),
                in_flight=self._pool.in_flight(r.engine_id),
                max_num_seqs=r.int_field("max_num_seqs"),
                epoch=r.epoch,
                matched_pending_blocks=r.matched_pending_blocks,
                queued_prefill_tokens=r.int_field("queued_prefill_tokens", UNKNOWN),
                num_decoding=r.int_field("num_decoding", UNKNOWN),
                prefill_tokens_per_s=r.float_field("prefill_tokens_per_s"),
                decode_s_per_seq=r.float_field("decode_s_per_seq"),
                own_prefilling=self._pool.prefilling(r.engine_id),
                own_prefill_tokens=self._pool.prefill_tokens(r.engine_id),
                role=r.fields.get("role", "both"),
                max_model_len=r.int_field("max_model_len"),
            )
            for r in records
            if r.address
        ]


def _whole_first(ranking: Sequence[EngineView], lora_id: str) -> EngineView | None:
    """Without the dispatcher's rules: the first engine if it surely takes the request whole
    (a prefill-role one may be skipped, a decode-role one may come second to a prefill)."""
    return ranking[0] if ranking and ranking[0].role == "both" else None


def _needs_whole_fleet(candidates: Sequence[EngineRecord], model: str) -> bool:
    """A candidate answer that cannot serve the request as every engine could: none of the
    candidates serves the model (or the LoRA adapter it names), or the fleet splits prefill
    and decode (both kinds must be ranked)."""
    if not candidates:
        return True
    if model and not any(r.model == model for r in candidates):
        return True
    return any(r.fields.get("role", "both") != "both" for r in candidates)


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
