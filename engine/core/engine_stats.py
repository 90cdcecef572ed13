"""The engine's figures for metrics and `LLM.get_stats()`: KV blocks and usage, queue sizes,
prefix-cache and token counters, the KV tiers' figures (zeros when a tier is off) and, when
speculative decoding is on, its counters.

Role: a read-only view of an `LLMEngine`, kept out of the engine loop's module; every name it
returns is mapped to a metric in engine.service.metrics.
"""

from __future__ import annotations

from typing import Protocol

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.kv_tiers.offload import HostKVBuffer
from engine.spec_decode.speculator import Speculator


class EngineParts(Protocol):
    """What the figures are read from (an `LLMEngine`)."""

    kv: KVCacheManager
    scheduler: Scheduler
    host_kv: HostKVBuffer | None
    speculator: Speculator | None
    prompt_tokens: int
    generation_tokens: int


def engine_stats(engine: EngineParts) -> dict[str, int | float]:
    """Every figure the engine reports, by name (engine.service.metrics maps them to metrics)."""
    return {
        "kv_blocks_total": engine.kv.num_blocks,
        "kv_blocks_free": engine.kv.num_free_blocks,
        "kv_cache_usage": engine.kv.usage,
        "num_requests_running": engine.scheduler.num_running,
        "num_requests_waiting": engine.scheduler.num_waiting,
        "prefix_cache_queries": engine.kv.stats.queries,
        "prefix_cache_hits": engine.kv.stats.hits,
        "num_preemptions": engine.scheduler.num_preemptions,
        "prompt_tokens": engine.prompt_tokens,
        "generation_tokens": engine.generation_tokens,
        **_kv_tier_stats(engine),
        **(engine.speculator.stats.as_dict() if engine.speculator is not None else {}),
    }


def _kv_tier_stats(engine: EngineParts) -> dict[str, int | float]:
    """Swap and host-tier figures (zeros when a tier is off), for metrics."""
    swap, tier, host = engine.kv.swap, engine.kv.host_tier, engine.host_kv
    return {
        "num_requests_swapped": engine.scheduler.num_swapped,
        "swap_blocks_total": 0 if swap is None else swap.num_blocks,
        "swap_space_usage": 0.0 if swap is None else swap.usage,
        "swapped_out_blocks": 0 if swap is None else swap.stats.swapped_out_blocks,
        "swapped_in_blocks": 0 if swap is None else swap.stats.swapped_in_blocks,
        "host_cache_blocks_total": 0 if tier is None else tier.num_blocks,
        "host_cache_usage": 0.0 if tier is None else tier.usage,
        "host_cache_hits": 0 if tier is None else tier.stats.hits,
        "host_cache_misses": 0 if tier is None else tier.stats.misses,
        "host_cache_evictions": 0 if tier is None else tier.stats.evictions,
        "host_cache_stored": 0 if tier is None else tier.stats.stored,
        "prefix_cache_host_hits": engine.kv.stats.host_hits,
        "kv_transfer_bytes_to_host": 0 if host is None else host.stats.bytes_to_host,
        "kv_transfer_bytes_to_device": 0 if host is None else host.stats.bytes_to_device,
    }
