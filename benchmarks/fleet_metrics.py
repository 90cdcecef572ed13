"""What the fleet benchmark reads off the servers, and the best prefix-cache hit rate possible.

Pure functions (no servers), unit-tested in tests/unit/test_fleet_bench.py:
- `counters` sums, from one Prometheus /metrics text, the counters compared: prefix-cache
  queries and hits (prompt tokens looked up / found) and finished requests, under the
  server's prefix (`kvfleet:` engines export vLLM's names under `kvfleet:`; `vllm serve`
  exports `vllm:`), over every label set (finish reasons, engines);
- `delta` and `hit_rate` turn two snapshots of every engine (before / after a case) into what
  that case did: hits / queries over the engines, and requests per engine;
- `prefix_ceiling` is the hit rate a perfect cache could reach on the prompts actually sent:
  every shared prefix computed once, every later prompt hitting it. At `block_size` 1 that is
  token-level (the issue's definition: tokens that could be hits over all prompt tokens); at a
  server's block size it counts only whole blocks, as a block cache can (a 16-token cache
  cannot hit the last 15 tokens of a 511-token shared prefix). As in vLLM, at least the last
  prompt token is always computed (the hit length is capped at prompt length - 1).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "request_success")
Snapshot = dict[str, dict[str, float]]  # engine name -> counter -> value
_SAMPLE = re.compile(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)")
_BLOCK_SIZE = re.compile(r'[{,]block_size="(\d+)"')


def counters(text: str, prefix: str) -> dict[str, float]:
    """COUNTERS summed over their label sets (`NAME_total`, or plain `NAME`), 0 when absent."""
    out = dict.fromkeys(COUNTERS, 0.0)
    names = {f"{prefix}{c}{suffix}": c for c in COUNTERS for suffix in ("_total", "")}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in names:
            out[names[m.group(1)]] += float(m.group(3))
    return out


def labelled_counter(text: str, name: str, label: str) -> dict[str, float]:
    """Counter `name` (`_total` or plain) summed per value of `label`."""
    pattern = re.compile(rf'[{{,]{re.escape(label)}="([^"]*)"')
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in (name, f"{name}_total") and m.group(2):
            key = pattern.search(m.group(2))
            if key:
                out[key.group(1)] = out.get(key.group(1), 0.0) + float(m.group(3))
    return out


def block_size(text: str, prefix: str = "vllm:") -> int | None:
    """The KV block size vLLM reports in `vllm:cache_config_info{block_size=...}`, if any."""
    for line in text.splitlines():
        if line.startswith(f"{prefix}cache_config_info{{") and (m := _BLOCK_SIZE.search(line)):
            return int(m.group(1))
    return None


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """Per engine and counter, after - before (an engine missing before counts from 0)."""
    return {engine: {c: v - before.get(engine, {}).get(c, 0.0) for c, v in values.items()}
            for engine, values in after.items()}


def hit_rate(change: Snapshot) -> float | None:
    """Prefix-cache hits / queries over all engines (None when nothing was looked up)."""
    queries = sum(v["prefix_cache_queries"] for v in change.values())
    hits = sum(v["prefix_cache_hits"] for v in change.values())
    return hits / queries if queries > 0 else None


def requests_per_engine(change: Snapshot) -> dict[str, int]:
    return {engine: round(v["request_success"]) for engine, v in sorted(change.items())}


def prefix_ceiling(prompts: Sequence[Sequence[int]], block_size: int = 1) -> float:
    """Hit tokens / prompt tokens if every shared prefix (of whole `block_size` blocks) were
    computed once and found by every later prompt; order does not matter."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[int] = set()
    hits = total = 0
    for tokens in prompts:
        total += len(tokens)
        key = 0
        for b in range(max(0, len(tokens) - 1) // block_size):
            # A chained key: block b matches only after the same blocks 0..b-1.
            key = hash((key, tuple(tokens[b * block_size:(b + 1) * block_size])))
            if key in seen:
                hits += block_size
            else:
                seen.add(key)
    return hits / total if total else 0.0


def ceilings(prompts: Sequence[Sequence[int]], block_sizes: Mapping[str, int]) -> dict[str, float]:
    """The token-level ceiling ("token") and one per named block size."""
    return {"token": prefix_ceiling(prompts),
            **{name: prefix_ceiling(prompts, size) for name, size in block_sizes.items()}}
