"""Routing policies as pure functions: engines in, engines ranked best-first out.

Role: the decision logic, free of I/O so it is unit-testable with exact expected choices.
`router.routing.decision` feeds it what Redis (or the engines themselves) reported plus this
router's own in-flight counts; `router.engines.dispatch` tries the ranking in order (retry = next
entry).

Policies:

- `prefix` (default): cheapest estimated time to first token, where a cached prefix is
  worth the compute it saves (`router.routing.ttft_cost` has the formula and its defaults).
  Every engine's cost is the prompt work queued on it (published by the engine, or this
  router's own requests without a first token when those are more), plus the prompt tokens
  *this* request would compute there (the prompt minus the blocks it holds on the device, in
  its host tier at a discount, or has *pending*: just sent there by some router and not yet
  published), all at the engine's measured prefill rate, plus one decode step of its running
  decodes; an engine whose KV cache is nearly full pays more for new blocks.
  A hot prefix therefore stays on its engine while waiting there is cheaper than recomputing
  the prefix elsewhere, and spills to another engine exactly when the estimate there,
  recompute included, is shorter; a second request of a prefix follows the first before the
  engine has published it (pending entries, `router.routing.pending`).
  Estimates within the tie tolerance of the best (20% + 10 ms: measured rates of alike
  engines differ by noise) come first, the one holding most of the prompt first; between
  engines holding as much (a new prefix: none), the fewest prompt tokens queued (counted,
  not timed: measured rates are noisy), then the fewest requests (`EngineView.load`), then
  the highest rendezvous weight of (tenant + prompt start, engine id): among equals every
  replica picks the same engine without talking, and new prefixes spread over an idle
  fleet. A new prefix stays where it lands, followers included, so it goes where the least
  prompt work (prefixes and their followers' suffixes) is queued, not where fewer requests
  wait. The other engines follow, cheapest first.
- `least_load`: lowest load, then lowest KV usage, then the rendezvous hash.
- `round_robin`: engines sorted by id, rotated by a counter the caller owns (per replica;
  replicas need not agree for round robin to be fair overall).

Each decision also names why its first engine won (`choice_reason`), for metrics and traces:
"cached" (it holds the most of the prompt), "pending" (as many, some of it only pending),
"spill" (another engine holds more, but waiting there costs more), "hash" (nobody holds any;
the rendezvous hash broke a tie between engines as queued and as loaded), "least_load" (nobody
holds any and it is the cheapest, or the least queued or loaded of the ties, or the least_load
policy),
"round_robin".

Invariants: every function returns a permutation of its input (no engine is dropped, so
retries can reach every engine); results depend only on the arguments.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence

from router.routing.engine_view import EngineView
from router.routing.ttft_cost import (
    Estimate,
    PrefixPolicyConfig,
    RequestShape,
    estimate_all,
    infer_shape,
    near_best,
)

__all__ = [
    "EngineView",
    "Policy",
    "PrefixPolicyConfig",
    "RequestShape",
    "choice_reason",
    "rank",
    "rank_least_load",
    "rank_prefix",
    "rank_round_robin",
    "rendezvous_weight",
]


class Policy(enum.StrEnum):
    PREFIX = "prefix"
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"


def rendezvous_weight(tie_key: bytes, engine_id: str) -> int:
    """A stable pseudo-random weight of (key, engine): every replica computes the same one."""
    digest = hashlib.blake2b(tie_key + b"\x00" + engine_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rank_prefix(
    engines: Sequence[EngineView],
    tie_key: bytes,
    config: PrefixPolicyConfig,
    shape: RequestShape | None = None,
    costs: Mapping[str, Estimate] | None = None,
) -> list[EngineView]:
    """Cheapest estimated time to first token first (module docstring).

    `shape` None (a caller that knows no prompt length): one block past the longest match.
    `costs`: `estimate_all(engines, shape, config)` when the caller has it already.
    """
    if not engines:
        return []
    if costs is None:
        costs = estimate_all(engines, shape or infer_shape(engines), config)
    near = near_best(costs, config)

    def preference(e: EngineView) -> tuple[bool, float, int, int, float, int]:
        # Among near-equal estimates the cache decides (a hit is work saved for everyone
        # after this request too); between engines holding as much, the fewest prompt
        # tokens queued, then the fewest requests, then the hash; beyond the ties, the
        # estimate itself. A new prefix stays where it lands, with every follower it
        # brings: placed by request count first, it went to the engine whose requests were
        # fewer but were more prefixes (followers are cheap, prefixes are not), and 30% of
        # shuffled 8-prefix bursts ended 60/36 (tests/unit/test_routing_replay.py). Tokens,
        # not the estimate's seconds: tied estimates differ by noise (rates, KV usage), and a
        # tie-break by seconds sent every new tenant of a test fleet to one engine.
        tied = e.engine_id in near
        cost = costs[e.engine_id]
        return (not tied, -config.score(e) if tied else 0.0,
                cost.queued_tokens if tied else 0, e.load if tied else 0,
                0.0 if tied else cost.ttft_s, -rendezvous_weight(tie_key, e.engine_id))

    return sorted(engines, key=preference)


def choice_reason(
    policy: Policy,
    ranking: Sequence[EngineView],
    config: PrefixPolicyConfig,
    shape: RequestShape | None = None,
    costs: Mapping[str, Estimate] | None = None,
) -> str:
    """Why `ranking[0]` won (module docstring); "" for an empty ranking."""
    if not ranking:
        return ""
    if policy is not Policy.PREFIX:
        return policy.value
    best, rest = ranking[0], ranking[1:]
    most = max(config.score(e) for e in ranking)
    if most > 0:
        if config.score(best) < most:
            return "spill"
        return "pending" if best.matched_pending_blocks else "cached"
    if costs is None:
        costs = estimate_all(ranking, shape or infer_shape(ranking), config)
    near = near_best(costs, config)
    tied = [e for e in rest if e.engine_id in near]
    # Among ties the fewest queued tokens, then the fewest requests went first; the hash
    # decided only between equals.
    queued = costs[best.engine_id].queued_tokens
    return ("hash" if any(e.load == best.load and costs[e.engine_id].queued_tokens == queued
                          for e in tied) else "least_load")


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
    shape: RequestShape | None = None,
    costs: Mapping[str, Estimate] | None = None,
) -> list[EngineView]:
    """Dispatch to the policy's ranking function (`costs`: see `rank_prefix`)."""
    if policy is Policy.PREFIX:
        return rank_prefix(engines, tie_key, config, shape, costs)
    if policy is Policy.LEAST_LOAD:
        return rank_least_load(engines, tie_key)
    return rank_round_robin(engines, counter)
