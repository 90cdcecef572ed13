"""The router's Prometheus metrics (served on --metrics-port; see kvfleet.runtime.metrics).

Names (counters get `_total` in the exposition, histograms `_bucket/_sum/_count`):
- kvfleet:router_requests{tenant,code}: Generate calls by tenant and final gRPC status.
- kvfleet:router_routing_decisions{policy,engine_id,reason}: the engine each request was
  sent to, the policy that ranked it (prefix falls back to least_load while Redis is down)
  and why that engine won (router.routing.ranking.choice_reason: cached, pending, spill,
  hash, least_load, round_robin; lora_placement; retry when an earlier choice failed).
- kvfleet:router_predicted_cached_tokens{engine_id} / kvfleet:router_actual_cached_tokens
  {engine_id}: prompt tokens the prefix index promised (held or pending) vs what the engine
  reported cached; their rate ratio is the router's drift. kvfleet:router_cached_tokens_drift
  is the per-request histogram of |predicted - actual|, and
  kvfleet:router_prefix_prediction_error_tokens the signed one, predicted - actual (> 0: the
  router expected a hit the engine did not have, e.g. a pending prefix not computed in time
  or evicted; < 0: a hit it did not know of).
- kvfleet:router_engine_num_running / _num_waiting / _kv_cache_usage_perc / _in_flight
  {engine_id}: engine load as this router last saw it (Redis registry + own in-flight).
- kvfleet:router_redis_latency_seconds, kvfleet:router_redis_errors: prefix-index lookups
  (errors: Redis unreachable or failing; the router then routes by load for a while).
- kvfleet:router_redis_pool_timeouts: lookups that found every Redis connection of this
  router busy for --redis-pool-timeout (Redis is up; that one decision went without it).
- kvfleet:router_engine_load_polls{outcome}: GetLoad calls while routing without Redis, by
  outcome: ok, timeout (a busy engine, still routed to), unavailable (suspect), error.
- kvfleet:router_rate_limited{tenant,limit}: requests refused (HTTP 429 / RESOURCE_EXHAUSTED)
  because the tenant was over a limit: requests, tokens or concurrency.
- kvfleet:router_rate_limit_fallbacks: admissions decided by this replica alone (limit /
  replicas) because Redis was unreachable.
- kvfleet:router_policy_reloads{outcome}: tenant policy file reloads, ok or error (the
  previous policy stays in force).
- kvfleet:router_lora_adapter_loads{engine_id,outcome}: LoRA adapters this router loaded on
  an engine because every engine serving them was saturated (router.routing.lora_placement), by
  outcome: loaded or failed.

Tenant names appear only in the `tenant` labels, and only on the metrics port
(--metrics-port, for scrapers); the HTTP API's /metrics leaves every tenant-labelled
series out (`router.http.vllm_endpoints`).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.routing.ranking import EngineView

PREFIX = "kvfleet:router"
REDIS_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)
# Decision to send: ~0 when nothing is awaited between them, a GetLoad or a busy loop shows.
HOLD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DRIFT_BUCKETS = (0, 1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Signed: both directions of a misprediction, in the same steps as DRIFT_BUCKETS.
ERROR_BUCKETS = tuple(-b for b in reversed(DRIFT_BUCKETS[2:])) + (-1, 0) + DRIFT_BUCKETS[2:]


class RouterMetrics:
    """All router metrics in one registry (a private one unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._engine_gauges: dict[str, tuple[Gauge, Gauge, Gauge, Gauge]] = {}
        # The loads last set per engine (observe_loads sets only changes).
        self._last_loads: dict[str, tuple[int, int, float, int]] = {}
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "Generate requests by tenant and final status code",
            ["tenant", "code"], registry=r,
        )
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "OpenAI HTTP API requests by tenant and HTTP status",
            ["tenant", "status"], registry=r,
        )
        self.retries = Counter(
            f"{PREFIX}_retries",
            "Requests sent on to the next engine after a failed attempt before the first token, "
            "by the failure's status code",
            ["reason"], registry=r,
        )
        self.decisions = Counter(
            f"{PREFIX}_routing_decisions",
            "Requests sent to an engine, by policy, engine and why that engine was chosen",
            ["policy", "engine_id", "reason"], registry=r,
        )
        self.predicted = Counter(
            f"{PREFIX}_predicted_cached_tokens",
            "Prompt tokens the prefix index predicted cached on the chosen engine",
            ["engine_id"], registry=r,
        )
        self.actual = Counter(
            f"{PREFIX}_actual_cached_tokens",
            "Prompt tokens the chosen engine reported served from its prefix cache",
            ["engine_id"], registry=r,
        )
        self.drift = Histogram(
            f"{PREFIX}_cached_tokens_drift", "Per request |predicted - actual| cached tokens",
            buckets=DRIFT_BUCKETS, registry=r,
        )
        self.prediction_error = Histogram(
            f"{PREFIX}_prefix_prediction_error_tokens",
            "Per request predicted - actual cached prompt tokens on the chosen engine",
            buckets=ERROR_BUCKETS, registry=r,
        )
        self.engine_running = Gauge(
            f"{PREFIX}_engine_num_running", "Running requests of an engine, as last seen",
            ["engine_id"], registry=r,
        )
        self.engine_waiting = Gauge(
            f"{PREFIX}_engine_num_waiting", "Waiting requests of an engine, as last seen",
            ["engine_id"], registry=r,
        )
        self.engine_kv_usage = Gauge(
            f"{PREFIX}_engine_kv_cache_usage_perc", "KV cache usage (0-1), as last seen",
            ["engine_id"], registry=r,
        )
        self.engine_in_flight = Gauge(
            f"{PREFIX}_engine_in_flight", "Streams this router has open to an engine",
            ["engine_id"], registry=r,
        )
        self.decision_hold = Histogram(
            f"{PREFIX}_decision_hold_seconds",
            "From a routing decision to its request's send (the engine held meanwhile)",
            buckets=HOLD_BUCKETS, registry=r,
        )
        self.redis_latency = Histogram(
            f"{PREFIX}_redis_latency_seconds", "Prefix-index lookup round trips to Redis",
            buckets=REDIS_LATENCY_BUCKETS, registry=r,
        )
        self.redis_errors = Counter(
            f"{PREFIX}_redis_errors", "Prefix-index lookups that failed", registry=r
        )
        self.redis_pool_timeouts = Counter(
            f"{PREFIX}_redis_pool_timeouts",
            "Prefix-index lookups that found every Redis connection busy", registry=r,
        )
        self.load_polls = Counter(
            f"{PREFIX}_engine_load_polls", "GetLoad calls while routing without Redis",
            ["outcome"], registry=r,
        )

        self.rate_limited = Counter(
            f"{PREFIX}_rate_limited", "Requests refused because the tenant was over a limit",
            ["tenant", "limit"], registry=r,
        )
        self.rate_limit_fallbacks = Counter(
            f"{PREFIX}_rate_limit_fallbacks",
            "Rate-limit admissions decided per replica because Redis was unreachable",
            registry=r,
        )
        self.policy_reloads = Counter(
            f"{PREFIX}_policy_reloads", "Tenant policy file reloads by outcome",
            ["outcome"], registry=r,
        )
        self.lora_adapter_loads = Counter(
            f"{PREFIX}_lora_adapter_loads",
            "LoRA adapters loaded on an engine because every engine serving them was saturated",
            ["engine_id", "outcome"], registry=r,
        )

    def observe_loads(self, views: Sequence[EngineView]) -> None:
        last = self._last_loads
        for view in views:
            # Only what changed: each set takes the gauge's lock, four per engine per decision,
            # and an engine's load is mostly the same from one decision to the next.
            loads = (view.num_running, view.num_waiting, view.kv_cache_usage, view.in_flight)
            if last.get(view.engine_id) == loads:
                continue
            last[view.engine_id] = loads
            running, waiting, kv_usage, in_flight = self._load_gauges(view.engine_id)
            running.set(view.num_running)
            waiting.set(view.num_waiting)
            kv_usage.set(view.kv_cache_usage)
            in_flight.set(view.in_flight)

    def _load_gauges(self, engine: str) -> tuple[Gauge, Gauge, Gauge, Gauge]:
        # Once per decision for every engine: `labels()` (a lock and a tuple key per call)
        # was a third of a decision's CPU at 128 engines (benchmarks/fleet_sim/decision_cost).
        gauges = self._engine_gauges.get(engine)
        if gauges is None:
            gauges = self._engine_gauges[engine] = (
                self.engine_running.labels(engine), self.engine_waiting.labels(engine),
                self.engine_kv_usage.labels(engine), self.engine_in_flight.labels(engine))
        return gauges

    def record_retry(self, reason: str) -> None:
        self.retries.labels(reason).inc()

    def record_decision(
        self, policy: str, engine_id: str, predicted_tokens: int, reason: str = ""
    ) -> None:
        self.decisions.labels(policy, engine_id, reason or policy).inc()
        self.predicted.labels(engine_id).inc(predicted_tokens)

    def record_cached(self, engine_id: str, predicted_tokens: int, actual_tokens: int) -> None:
        self.actual.labels(engine_id).inc(actual_tokens)
        self.drift.observe(abs(predicted_tokens - actual_tokens))
        self.prediction_error.observe(predicted_tokens - actual_tokens)
