"""Routing policies as pure functions: engines in, engines ranked best-first out.

Role: the decision logic, free of I/O so it is unit-testable with exact expected choices.
`router.routing.decision` feeds it what Redis (or the engines themselves) reported plus this
router's own in-flight counts; `router.engines.dispatch` tries the ranking in order (retry = next
entry).

Policies:

- `prefix` (default): consistent hashing with bounded loads, where a cache hit beats the
  hash. Every engine's *load* is `max(num_running + num_waiting, in_flight)`: Redis'
  figures include other routers' requests but lag a little; this router's in-flight count
  is exact for its own requests, so a burst is not all sent to one stale minimum.
  The bound: an engine is *eligible* only while its load is at most
  `min_load + max(load_slack_abs, load_slack_rel * min_load)`.
  Among eligible engines the one with the best cached-prefix score wins: device blocks
  count 1 each, blocks in the engine's host tier (`--kv-offloading-size`) count
  `host_hit_weight` each (default 0.5: a reload skips the compute but costs a copy), so a
  host hit beats no hit and loses to as long a device hit. Equal non-zero scores go to the
  lower load. When no eligible engine holds any block (a new
  prefix, or one still being prefilled and not yet published), the winner is the highest
  rendezvous weight of (tenant + prompt start, engine id): every replica, and every
  concurrent request of that prefix, picks the same engine without talking, so a prefix is
  computed once rather than on whichever engine looked idlest at each instant.
  A hot prefix therefore stays on its engine only until that engine is `slack` requests
  busier than the idlest one; then the next best eligible engine gets it (and caches it
  too), so traffic never piles onto one engine while others idle.
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
    # Leading blocks of this prompt that the engine holds in its prefix cache (on the device).
    matched_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # This router's requests currently streaming from the engine.
    in_flight: int = 0
    # Blocks continuing that run which the engine holds in its host tier.
    matched_host_blocks: int = 0
    # Sequences the engine runs at once at most (0: not published); see
    # router.routing.lora_placement.
    max_num_seqs: int = 0

    @property
    def load(self) -> int:
        return max(self.num_running + self.num_waiting, self.in_flight)


@dataclass(frozen=True)
class PrefixPolicyConfig:
    """The bound on prefix affinity (see the module docstring)."""

    load_slack_abs: int = 4
    load_slack_rel: float = 0.5
    # What a host-tier block is worth against a device block (1.0) when ranking engines.
    host_hit_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.load_slack_abs < 0 or self.load_slack_rel < 0:
            raise ValueError("load slack must be non-negative")
        if not 0.0 <= self.host_hit_weight <= 1.0:
            raise ValueError(f"host hit weight must be in [0, 1], got {self.host_hit_weight}")

    def score(self, engine: EngineView) -> float:
        """Cached-prefix score of an engine for this prompt (module docstring)."""
        return engine.matched_blocks + self.host_hit_weight * engine.matched_host_blocks

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
    max_load = config.max_load(min(e.load for e in engines))
    eligible = [e for e in engines if e.load <= max_load]
    rest = [e for e in engines if e.load > max_load]

    def preference(e: EngineView) -> tuple[float, int, int]:
        # Load only separates engines holding the same non-zero prefix; without a hit
        # the hash decides, so concurrent requests of a new prefix agree.
        score = config.score(e)
        load = e.load if score else 0
        return (-score, load, -rendezvous_weight(tie_key, e.engine_id))

    # Engines beyond the bound stay reachable for retries, least loaded first.
    return sorted(eligible, key=preference) + rank_least_load(rest, tie_key)


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
