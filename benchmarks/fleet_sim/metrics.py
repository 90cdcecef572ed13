"""Per-policy figures from one simulated run.

- hit_rate: prompt tokens served from the prefix cache / prompt tokens, over the requests
  admitted by an engine (token-level, as engines count prefix_cache_hits / queries).
- miss_share: the share of those requests that found nothing of their prompt cached (a
  tenant's system prompt computed again, or for the first time): they set the TTFT tail.
- ideal_hit_rate: the same if every block were computed once fleet-wide (one infinite cache
  holding every prompt's and every answer's blocks); ideal_miss_share: the share of requests
  that would find nothing even then (their prefix's first appearance). When it is above 10%
  no routing can bring the TTFT P90 below a miss's own prefill time.
- hit_ttft_p90_s / miss_ttft_p50_s: the TTFT P90 of the requests that found part of their
  prompt cached, and the median of those that found none (what a miss costs).
- ttft_p50/p90/p99_s: first token - arrival, in virtual seconds; a request with no first
  token when the run ended counts with (end - arrival), a lower bound (`unfinished`).
- max_over_mean_load: the busiest engine's busy time (sum of its step durations) over the
  mean engine's; max_over_mean_requests: the same for requests received.
- throughput_rps: requests finished / virtual seconds until the last finish.
- decision_p50/p99_ms: wall time of `EngineSelector.decide` (hashing, one Redis round trip on
  the real Redis at this fleet size, the ranking); 0 for the oracle, which makes no call.
  decision_cpu_p99_ms: the router process' CPU time of the same calls (the Redis server's is
  not in it): what stays meaningful when the machine is oversubscribed.

Requests arriving before `warmup_s` are left out of the hit rates and TTFTs (cold caches).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks.fleet_sim.simulator import RunRecord
from kvfleet.contracts.block_hash import hash_token_blocks


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summarize(run: RunRecord, warmup_s: float, block_size: int) -> dict[str, float]:
    measured = [r for r in run.requests if r.arrival_s >= warmup_s]
    admitted = [r for r in measured if r.first_token_s >= 0 or r.computed > 0]
    prompt = sum(r.prompt_len for r in admitted) or 1
    ttfts = [(r.first_token_s if r.first_token_s >= 0 else run.end_s) - r.arrival_s
             for r in measured]
    finished = [r for r in run.requests if r.finish_s >= 0]
    last = max((r.finish_s for r in finished), default=0.0) or 1.0
    busy = [e.busy_s for e in run.engines]
    received = [float(e.requests) for e in run.engines]
    hit_ttfts = [t for r, t in zip(measured, ttfts, strict=True) if r.cached_tokens > 0]
    miss_ttfts = [t for r, t in zip(measured, ttfts, strict=True)
                  if r.cached_tokens == 0 and (r.first_token_s >= 0 or r.computed > 0)]
    ideal_hit, ideal_miss = ideal_hits(run, warmup_s, block_size)
    ms = [s * 1000.0 for s in run.decision_s]
    cpu_ms = [s * 1000.0 for s in run.decision_cpu_s]
    return {
        "requests": float(len(run.requests)),
        "unfinished": float(sum(1 for r in measured if r.first_token_s < 0)),
        "hit_rate": sum(r.cached_tokens for r in admitted) / prompt,
        "miss_share": sum(1 for r in admitted if r.cached_tokens == 0) / max(len(admitted), 1),
        "ideal_hit_rate": ideal_hit,
        "ideal_miss_share": ideal_miss,
        "max_over_mean_load": _max_over_mean(busy),
        "max_over_mean_requests": _max_over_mean(received),
        "ttft_p50_s": quantile(ttfts, 0.50),
        "ttft_p90_s": quantile(ttfts, 0.90),
        "ttft_p99_s": quantile(ttfts, 0.99),
        "hit_ttft_p90_s": quantile(hit_ttfts, 0.90),
        "miss_ttft_p50_s": quantile(miss_ttfts, 0.50),
        "throughput_rps": len(finished) / last,
        "decision_p50_ms": quantile(ms, 0.50),
        "decision_p99_ms": quantile(ms, 0.99),
        "decision_cpu_p99_ms": quantile(cpu_ms, 0.99),
    }


def ideal_hit_rate(run: RunRecord, warmup_s: float, block_size: int) -> float:
    return ideal_hits(run, warmup_s, block_size)[0]


def ideal_hits(run: RunRecord, warmup_s: float, block_size: int) -> tuple[float, float]:
    """(ideal hit rate, ideal miss share): see the module docstring."""
    seen: set[bytes] = set()
    hit = total = requests = misses = 0
    for r in sorted(run.requests, key=lambda r: r.arrival_s):
        limit = (r.prompt_len - 1) // block_size
        n = 0
        for h in r.hashes[:limit]:
            if h not in seen:
                break
            n += 1
        if r.arrival_s >= warmup_s:
            hit += n * block_size
            total += r.prompt_len
            requests += 1
            misses += n == 0
        seen.update(r.hashes)
        # The engine caches the answer's full blocks too; the follow-up's prompt holds them.
        parent = r.hashes[-1] if r.hashes else None
        seen.update(hash_token_blocks([*r.prompt, *r.output], block_size, cache_salt=r.tenant,
                                      parent=parent, start_block=len(r.hashes)))
    return (hit / total if total else 0.0), (misses / requests if requests else 0.0)


def _max_over_mean(values: Sequence[float]) -> float:
    mean = statistics.fmean(values) if values else 0.0
    return max(values) / mean if mean > 0 else 0.0
