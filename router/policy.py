"""Routing policies as pure functions: engines in, engines ranked best-first out.

Role: the decision logic, free of I/O so it is unit-testable with exact expected choices.
`router.routing` feeds it what Redis (or the engines themselves) reported plus this router's
own in-flight counts; `router.forward` tries the ranking in order (retry = next entry).

Policies:

- `prefix` (default). Every engine's *load* is `max(num_running + num_waiting, in_flight)`:
  Redis' figures include other routers' requests but lag a little; this router's in-flight
  count is exact for its own requests, so bursts are not all sent to one stale minimum.
  The bound: an engine is *eligible* only while its load is at most
  `min_load + max(load_slack_abs, load_slack_rel * min_load)`, and engines at or above
  `kv_usage_limit` KV usage are ineligible while any engine is below it. Among eligible
  engines the one holding the most leading prompt blocks wins; ties go to the lower load,
  then to the smaller cache footprint (spreads new prefixes so each engine's cache holds a
  share of them), then to a rendezvous hash of (prompt's first block, engine id), so that
  router replicas agree without talking. A hot prefix therefore stays on its engine only
  until that engine is `slack` requests busier than the idlest one; then the idlest engine
  gets it (and caches it too), so traffic can never pile onto one engine while others idle.
- `least_load`: lowest load, then lowest KV usage, then the rendezvous hash.
- `round_robin`: engines sorted by id, rotated by a counter the caller owns (per replica;
  replicas need not agree for round robin to be fair overall).

Invariants: every function returns a permutation of its input (no engine is dropped, so
retries can reach every engine); results depend only on the arguments.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


class Policy(enum.StrEnum):
    PREFIX = "prefix"
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"


@dataclass(frozen=True)
class EngineView:
    """What a routing decision knows about one live engine."""

    engine_id: str
    address: str
    # Leading blocks of this prompt that the engine holds in its prefix cache.
    matched_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # Blocks in the engine's prefix-cache index (its cache footprint).
    num_cached_blocks: int = 0
    # This router's requests currently streaming from the engine.
    in_flight: int = 0

    @property
    def load(self) -> int:
        return max(self.num_running + self.num_waiting, self.in_flight)


@dataclass(frozen=True)
class PrefixPolicyConfig:
    """The bound on prefix affinity (see the module docstring)."""

    load_slack_abs: int = 4
    load_slack_rel: float = 0.5
    kv_usage_limit: float = 0.95

    def __post_init__(self) -> None:
        if self.load_slack_abs < 0 or self.load_slack_rel < 0:
            raise ValueError("load slack must be non-negative")
        if not 0 < self.kv_usage_limit <= 1:
            raise ValueError(f"kv_usage_limit must be in (0, 1], got {self.kv_usage_limit}")

    def max_load(self, min_load: int) -> float:
        """The highest load an engine may have and still win on cached blocks."""
        return min_load + max(self.load_slack_abs, self.load_slack_rel * min_load)


def rendezvous_weight(tie_key: bytes, engine_id: str) -> int:
    """A stable pseudo-random weight of (key, engine): every replica computes the same one."""
    digest = hashlib.blake2b(tie_key + b"\x00" + engine_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rank_prefix(
    engines: Sequence[EngineView], tie_key: bytes, config: PrefixPolicyConfig
) -> list[EngineView]:
    """Best engine first: most cached blocks within the load bound (module docstring)."""
    if not engines:
        return []
    eligible, rest = _split_eligible(engines, config)

    def preference(e: EngineView) -> tuple[int, int, int, int]:
        rendezvous = rendezvous_weight(tie_key, e.engine_id)
        return (-e.matched_blocks, e.load, e.num_cached_blocks, -rendezvous)

    # Ineligible engines stay reachable for retries, least loaded first.
    return sorted(eligible, key=preference) + rank_least_load(rest, tie_key)


def _split_eligible(
    engines: Sequence[EngineView], config: PrefixPolicyConfig
) -> tuple[list[EngineView], list[EngineView]]:
    roomy = [e for e in engines if e.kv_cache_usage < config.kv_usage_limit]
    pool = roomy or list(engines)
    max_load = config.max_load(min(e.load for e in pool))
    eligible = [e for e in pool if e.load <= max_load]
    eligible_ids = {e.engine_id for e in eligible}
    return eligible, [e for e in engines if e.engine_id not in eligible_ids]


def rank_least_load(engines: Sequence[EngineView], tie_key: bytes) -> list[EngineView]:
    """Lowest load first; ties by KV usage, then the rendezvous hash."""
    return sorted(
        engines,
        key=lambda e: (e.load, e.kv_cache_usage, -rendezvous_weight(tie_key, e.engine_id)),
    )


def rank_round_robin(engines: Sequence[EngineView], counter: int) -> list[EngineView]:
    """Engines sorted by id, rotated so entry `counter mod len` comes first."""
    ordered = sorted(engines, key=lambda e: e.engine_id)
    if not ordered:
        return []
    start = counter % len(ordered)
    return ordered[start:] + ordered[:start]


def rank(
    policy: Policy,
    engines: Sequence[EngineView],
    *,
    tie_key: bytes,
    counter: int,
    config: PrefixPolicyConfig,
) -> list[EngineView]:
    """Dispatch to the policy's ranking function."""
    if policy is Policy.PREFIX:
        return rank_prefix(engines, tie_key, config)
    if policy is Policy.LEAST_LOAD:
        return rank_least_load(engines, tie_key)
    return rank_round_robin(engines, counter)
