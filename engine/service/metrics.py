"""The engine's Prometheus metrics: vLLM's names under `kvfleet:` (served on --metrics-port).

Role: `EngineMetrics.attach(async_engine)` registers two engine-thread listeners: per step,
the gauges and counters are brought up to date from `LLMEngine.get_stats()` (counters by
delta, so they stay monotonic); per request update, the latency and size histograms are
observed from the request's timestamps (`Request.arrival_time`, `first_scheduled_time`).

Names (all with a `model_name` label; counters get `_total` in the exposition):
- gauges: kvfleet:num_requests_running, kvfleet:num_requests_waiting,
  kvfleet:kv_cache_usage_perc (0-1, like vLLM); KV tiers (0 when off):
  kvfleet:num_requests_swapped, kvfleet:cpu_cache_usage_perc (swap space, vLLM v0's name),
  kvfleet:host_cache_usage_perc (host tier of the prefix cache)
- counters: kvfleet:prefix_cache_queries, kvfleet:prefix_cache_hits (tokens, device),
  kvfleet:num_preemptions, kvfleet:prompt_tokens, kvfleet:generation_tokens,
  kvfleet:request_success{finished_reason}; KV tiers: kvfleet:kv_swapped_out_blocks,
  kvfleet:kv_swapped_in_blocks, kvfleet:host_cache_hits / _misses / _evictions (blocks; a
  miss is a lookup the tier could not extend), kvfleet:host_cache_stored_blocks,
  kvfleet:prefix_cache_host_hits (tokens), kvfleet:kv_transfer_bytes{direction};
  speculative decoding (when on): kvfleet:spec_decode_num_drafts,
  kvfleet:spec_decode_num_draft_tokens, kvfleet:spec_decode_num_accepted_tokens,
  kvfleet:spec_decode_num_accepted_tokens_per_pos{position}; structured outputs:
  kvfleet:structured_output_requests (engine.service.structured_metrics)
- histograms: kvfleet:time_to_first_token_seconds, kvfleet:inter_token_latency_seconds,
  kvfleet:e2e_request_latency_seconds, kvfleet:request_queue_time_seconds,
  kvfleet:request_prompt_tokens, kvfleet:request_generation_tokens,
  kvfleet:iteration_tokens_total, kvfleet:structured_output_compile_seconds,
  kvfleet:structured_output_mask_seconds (per step with constrained rows)

Threading: every method runs on the engine thread; prometheus_client metrics are
thread-safe for the HTTP server thread that reads them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.core.kv_cache_manager import KVCacheEvents
from engine.core.scheduler_output import RequestUpdate
from engine.service.async_engine import AsyncEngine
from engine.service.structured_metrics import StructuredOutputMetrics

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
COUNTER_STATS = (
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
    "generation_tokens",
)
# get_stats() key -> (metric name, help) of the KV-tier counters.
TIER_COUNTERS = {
    "swapped_out_blocks": ("kv_swapped_out_blocks", "KV blocks copied to swap space"),
    "swapped_in_blocks": ("kv_swapped_in_blocks", "KV blocks copied back from swap space"),
    "host_cache_hits": ("host_cache_hits", "Prefix blocks reloaded from the host tier"),
    "host_cache_misses": (
        "host_cache_misses", "Prefix lookups the host tier could not extend"
    ),
    "host_cache_evictions": ("host_cache_evictions", "Blocks evicted from the host tier"),
    "host_cache_stored": ("host_cache_stored_blocks", "Blocks written to the host tier"),
    "prefix_cache_host_hits": (
        "prefix_cache_host_hits", "Prompt tokens found in the host tier"
    ),
}
# Speculative decoding (vLLM's names); get_stats() key = metric name without the prefix.
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "Speculative decoding: verifying steps of requests",
    "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens verified",
    "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens kept",
}
SPEC_PER_POS_PREFIX = "spec_decode_num_accepted_tokens_per_pos_"
TRANSFER_DIRECTIONS = {"kv_transfer_bytes_to_host": "to_host",
                       "kv_transfer_bytes_to_device": "to_device"}


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets) if buckets else (1.0,)
            buckets.append(float(value))
        exponent += 1


class EngineMetrics:
    """The engine's metrics in one registry (a private one unless given)."""

    def __init__(
        self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self._model = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvfleet:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvfleet:{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(f"kvfleet:{name}", doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage, 0-1 (1 = full)")
        self.counters = {
            "prefix_cache_queries": counter(
                "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
            ),
            "prefix_cache_hits": counter(
                "prefix_cache_hits", "Prompt tokens found in the prefix cache"
            ),
            "num_preemptions": counter("num_preemptions", "Preemptions (recompute)"),
            "prompt_tokens": counter("prompt_tokens", "Prefill tokens processed"),
            "generation_tokens": counter("generation_tokens", "Generation tokens processed"),
        }
        self.counters.update(
            {key: counter(name, doc) for key, (name, doc) in TIER_COUNTERS.items()}
        )
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to host memory")
        self.swap_usage = gauge("cpu_cache_usage_perc", "Swap space usage, 0-1")
        self.host_usage = gauge("host_cache_usage_perc", "Host KV tier usage, 0-1")
        self.transfer_bytes = Counter(
            "kvfleet:kv_transfer_bytes", "KV bytes copied between device and host memory",
            ["model_name", "direction"], registry=r,
        )
        self.success = Counter(
            "kvfleet:request_success", "Finished requests by finish reason",
            ["model_name", "finished_reason"], registry=r,
        )
        tokens = token_buckets(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to finish", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled", REQUEST_LATENCY_BUCKETS
        )
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens", tokens)
        self.request_generation = histogram(
            "request_generation_tokens", "Generated tokens", tokens
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step",
            token_buckets(max(max_model_len, 16384)),
        )
        self.spec_counters = {key: counter(key, doc) for key, doc in SPEC_DECODE_COUNTERS.items()}
        self.spec_per_pos = Counter(
            "kvfleet:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: drafts kept, by draft position (0 = first)",
            ["model_name", "position"], registry=r,
        )
        self.structured = StructuredOutputMetrics(model_name, r)
        self._last_counts: dict[str, int] = {}
        self._last_token_time: dict[str, float] = {}
        self._engine: AsyncEngine | None = None

    def attach(self, async_engine: AsyncEngine) -> None:
        """Observe `async_engine` (call before it starts)."""
        self._engine = async_engine
        self._last_counts = {k: 0 for k in (*COUNTER_STATS, *TIER_COUNTERS, *TRANSFER_DIRECTIONS)}
        async_engine.add_step_listener(self.on_step)
        async_engine.add_update_listener(self.on_updates)

    def on_step(self, events: KVCacheEvents) -> None:
        """After an engine iteration: gauges and counters from get_stats()."""
        if self._engine is None:
            return
        engine = self._engine.engine
        stats = engine.get_stats()
        model = self._model
        self.running.labels(model).set(stats["num_requests_running"])
        self.waiting.labels(model).set(stats["num_requests_waiting"])
        self.kv_usage.labels(model).set(stats["kv_cache_usage"])
        self.swapped.labels(model).set(stats["num_requests_swapped"])
        self.swap_usage.labels(model).set(stats["swap_space_usage"])
        self.host_usage.labels(model).set(stats["host_cache_usage"])
        for name, counter in self.counters.items():
            delta = self._delta(name, stats)
            if delta > 0:
                counter.labels(model).inc(delta)
        for name, direction in TRANSFER_DIRECTIONS.items():
            delta = self._delta(name, stats)
            if delta > 0:
                self.transfer_bytes.labels(model, direction).inc(delta)
        self._spec_decode(stats)
        self.structured.observe(engine.structured)

    def _spec_decode(self, stats: dict[str, int | float]) -> None:
        """Speculative decoding counters; get_stats() has them only when it is on."""
        if "spec_decode_num_drafts" not in stats:
            return
        for name, counter in self.spec_counters.items():
            delta = self._delta(name, stats)
            if delta > 0:
                counter.labels(self._model).inc(delta)
        for name in stats:
            if name.startswith(SPEC_PER_POS_PREFIX):
                delta = self._delta(name, stats)
                if delta > 0:
                    position = name.removeprefix(SPEC_PER_POS_PREFIX)
                    self.spec_per_pos.labels(self._model, position).inc(delta)

    def _delta(self, name: str, stats: dict[str, int | float]) -> int:
        value = int(stats[name])
        delta = value - self._last_counts.get(name, 0)
        self._last_counts[name] = value
        return delta

    def on_updates(self, updates: Sequence[RequestUpdate], stepped: bool) -> None:
        """Per-request histograms; `stepped`: the updates come from a model step."""
        now = time.monotonic()
        model = self._model
        if stepped and self._engine is not None:
            self.iteration_tokens.labels(model).observe(self._engine.engine.last_step_num_tokens)
        for update in updates:
            request = update.request
            request_id = request.request_id
            if update.new_token_ids:
                last = self._last_token_time.get(request_id)
                if last is None:
                    self.ttft.labels(model).observe(now - request.arrival_time)
                    if request.first_scheduled_time is not None:
                        self.queue_time.labels(model).observe(
                            request.first_scheduled_time - request.arrival_time
                        )
                else:
                    self.itl.labels(model).observe(now - last)
                self._last_token_time[request_id] = now
            if update.finished:
                self._last_token_time.pop(request_id, None)
                self.e2e.labels(model).observe(now - request.arrival_time)
                self.request_prompt.labels(model).observe(request.num_prompt_tokens)
                self.request_generation.labels(model).observe(request.num_output_tokens)
                reason = request.status.finish_reason or "abort"
                self.success.labels(model, reason).inc()
