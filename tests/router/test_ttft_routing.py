"""The prefix policy's cost model on tiny fleets: exact engine choices (router.routing.ttft_cost).

Every engine publishes 1000 prompt tokens/s and 10 ms per decoding sequence unless a test says
otherwise, so estimates read as tokens: 0.544 s is 544 tokens of prefill. The prompt is a
512-token prefix (32 blocks of 16) plus a 32-token suffix: 544 tokens, 33 full blocks hashed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from router.routing.engine_view import EngineView
from router.routing.pending import PendingClaims, PendingConfig, drain
from router.routing.ranking import (
    Policy,
    PrefixPolicyConfig,
    RequestShape,
    choice_reason,
    rank,
    rank_prefix,
    rendezvous_weight,
)
from router.routing.ttft_cost import estimate_all

KEY = b"tie-key"
SHAPE = RequestShape(prompt_tokens=544, block_size=16)
PREFIX_BLOCKS = 32
DEFAULT = PrefixPolicyConfig()  # duplicate_weight 1.0, ties within 20% + 10 ms
EXACT = PrefixPolicyConfig(tie_rel=0.0, tie_abs_s=0.0)  # the duplicate charge, no tolerance
TIME_ONLY = PrefixPolicyConfig(duplicate_weight=0.0, tie_rel=0.0, tie_abs_s=0.0)


def engine(engine_id: str, *, rate: float = 1000.0, step: float = 0.01, **fields: object
           ) -> EngineView:
    values: dict[str, object] = {"queued_prefill_tokens": 0, "num_decoding": 0,
                                 "prefill_tokens_per_s": rate, "decode_s_per_seq": step}
    values.update(fields)
    return EngineView(engine_id, f"{engine_id}:1", epoch="e1", **values)  # type: ignore[arg-type]


def ranked(engines: Sequence[EngineView], config: PrefixPolicyConfig = DEFAULT) -> list[str]:
    return [e.engine_id for e in rank_prefix(engines, KEY, config, SHAPE)]


def reason(engines: Sequence[EngineView], config: PrefixPolicyConfig = DEFAULT) -> str:
    return choice_reason(Policy.PREFIX, rank_prefix(engines, KEY, config, SHAPE), config, SHAPE)


def ttft(engines: Sequence[EngineView], config: PrefixPolicyConfig = DEFAULT) -> dict[str, float]:
    return {i: round(e.ttft_s, 6) for i, e in estimate_all(engines, SHAPE, config).items()}


HASH_FIRST, HASH_SECOND = sorted("ab", key=lambda i: -rendezvous_weight(KEY, i))


def test_a_new_prefix_on_an_idle_fleet_goes_by_the_hash() -> None:
    engines = [engine("a"), engine("b")]
    assert ranked(engines) == [HASH_FIRST, HASH_SECOND]
    assert ranked(engines[::-1]) == [HASH_FIRST, HASH_SECOND]
    assert reason(engines) == "hash"
    assert ttft(engines) == {"a": 0.544, "b": 0.544}


def test_the_second_request_follows_the_first_through_its_pending_entries() -> None:
    # The first request went to HASH_FIRST a moment ago: this router has it in flight before
    # its first token (544 tokens to compute), its blocks are pending there, and the engine
    # has published nothing yet.
    first = dict(own_prefilling=1, own_prefill_tokens=544, in_flight=1)
    following = [engine(HASH_FIRST, matched_pending_blocks=PREFIX_BLOCKS, **first),
                 engine(HASH_SECOND)]
    # Waiting for the first (544) + its own suffix (32) beats recomputing the prefix on the
    # idle engine: 544 + 1.0 x 512 for the duplicate.
    assert ttft(following) == {HASH_FIRST: 0.576, HASH_SECOND: 1.056}
    assert ranked(following) == [HASH_FIRST, HASH_SECOND]
    assert reason(following) == "pending"
    # Without the pending entry (the old behaviour) the prefix looks cold everywhere and the
    # busy engine, 544 + 544 tokens, loses: the prefix would be computed twice.
    blind = [engine(HASH_FIRST, **first), engine(HASH_SECOND)]
    assert ranked(blind) == [HASH_SECOND, HASH_FIRST]
    # By time alone the idle engine is 32 tokens faster: the duplicate charge is what keeps
    # the second request with the first.
    assert ranked(following, TIME_ONLY) == [HASH_SECOND, HASH_FIRST]


@pytest.mark.parametrize(
    ("queued", "expected"),
    [(0, "h"), (1014, "h"), (1034, "o")],
)
def test_a_hot_prefix_spills_exactly_when_waiting_costs_more_than_recomputing(
    queued: int, expected: str
) -> None:
    # h holds the prefix: queued + 32 own tokens. o recomputes: 544 + 1.0 x 512 = 1056.
    engines = [engine("h", matched_blocks=PREFIX_BLOCKS, queued_prefill_tokens=queued),
               engine("o")]
    assert ttft(engines, EXACT) == {"h": (queued + 32) / 1000, "o": 1.056}
    assert ranked(engines, EXACT)[0] == expected
    assert reason(engines, EXACT) == ("cached" if expected == "h" else "spill")


@pytest.mark.parametrize(
    ("queued", "expected"),
    [(1014, "h"), (1240, "h"), (1260, "o")],
)
def test_by_default_the_holder_keeps_near_ties(queued: int, expected: str) -> None:
    # Within 20% + 10 ms of o's 1.056 s (1.2772 s) the holder wins the tie on its cache.
    engines = [engine("h", matched_blocks=PREFIX_BLOCKS, queued_prefill_tokens=queued),
               engine("o")]
    assert ranked(engines)[0] == expected
    assert reason(engines) == ("cached" if expected == "h" else "spill")


def test_a_new_prefix_spreads_by_the_hash_despite_rate_noise() -> None:
    # Alike engines whose measured rates differ by 10%: a tie, the hash decides.
    engines = [engine(HASH_FIRST, rate=900.0), engine(HASH_SECOND, rate=1000.0)]
    assert ranked(engines) == [HASH_FIRST, HASH_SECOND]
    assert reason(engines) == "hash"
    # Rates 1.5x apart are still alike (noise): read as their mean, equal estimates.
    engines = [engine(HASH_FIRST, rate=800.0), engine(HASH_SECOND, rate=1200.0)]
    assert ttft(engines) == {HASH_FIRST: 0.544, HASH_SECOND: 0.544}
    assert ranked(engines, TIME_ONLY) == [HASH_FIRST, HASH_SECOND]
    # A faster kind of engine (2x) keeps its rate: by time alone it takes every new prefix.
    engines = [engine(HASH_FIRST, rate=1000.0), engine(HASH_SECOND, rate=2000.0)]
    assert ttft(engines) == {HASH_FIRST: 0.544, HASH_SECOND: 0.272}
    assert ranked(engines, TIME_ONLY) == [HASH_SECOND, HASH_FIRST]
    # A real difference in queued work is no tie: 300 queued tokens is 55% more.
    engines = [engine(HASH_FIRST, queued_prefill_tokens=300), engine(HASH_SECOND)]
    assert ranked(engines) == [HASH_SECOND, HASH_FIRST]
    assert reason(engines) == "least_load"


def test_a_new_prefix_goes_to_the_least_loaded_of_the_tied_engines() -> None:
    # Two requests decoding on the hash's first choice: 0.564 s vs 0.544 s, a tie, but the
    # idle engine takes the new prefix (new prefixes stay where they land: the fleet
    # simulator's busiest engine went from 1.43x to 1.27x the mean's work).
    engines = [engine(HASH_FIRST, num_running=2, num_decoding=2), engine(HASH_SECOND)]
    assert ttft(engines) == {HASH_FIRST: 0.564, HASH_SECOND: 0.544}
    assert ranked(engines) == [HASH_SECOND, HASH_FIRST]
    assert reason(engines) == "least_load"
    # This router's own requests count as load too (before any engine publishes them).
    engines = [engine(HASH_FIRST, in_flight=1), engine(HASH_SECOND)]
    assert ranked(engines) == [HASH_SECOND, HASH_FIRST]
    # As loaded: the hash decides.
    engines = [engine(HASH_FIRST, num_running=1), engine(HASH_SECOND, num_running=1)]
    assert ranked(engines) == [HASH_FIRST, HASH_SECOND]
    assert reason(engines) == "hash"
    # The cache still comes first: the busier holder keeps its prefix.
    engines = [engine(HASH_SECOND, num_running=3, matched_blocks=PREFIX_BLOCKS),
               engine(HASH_FIRST)]
    assert ranked(engines)[0] == HASH_SECOND
    assert reason(engines) == "cached"


def test_by_time_alone_the_spill_point_is_the_recompute_time() -> None:
    holder = [engine("h", matched_blocks=PREFIX_BLOCKS, queued_prefill_tokens=500), engine("o")]
    assert ranked(holder, TIME_ONLY) == ["h", "o"]  # 532 < 544
    holder = [engine("h", matched_blocks=PREFIX_BLOCKS, queued_prefill_tokens=530), engine("o")]
    assert ranked(holder, TIME_ONLY) == ["o", "h"]  # 562 > 544
    # The other engine's own queue is part of its estimate: 300 + 544 > 562.
    busy_other = [engine("h", matched_blocks=PREFIX_BLOCKS, queued_prefill_tokens=530),
                  engine("o", queued_prefill_tokens=300)]
    assert ranked(busy_other, TIME_ONLY) == ["h", "o"]


def test_decoding_requests_and_measured_rates_count() -> None:
    # 30 decodes x 10 ms = 0.3 s on h; o computes at half the speed: 2.112 s.
    engines = [engine("h", matched_blocks=PREFIX_BLOCKS, num_decoding=30),
               engine("o", rate=500.0)]
    assert ttft(engines) == {"h": 0.332, "o": 2.112}
    assert ranked(engines) == ["h", "o"]
    engines = [engine("h", matched_blocks=PREFIX_BLOCKS, num_decoding=30, step=0.1),
               engine("o")]
    assert ranked(engines) == ["o", "h"]  # 3.032 s of decode steps against 1.056


def test_this_routers_unpublished_requests_count() -> None:
    # The registry says h is idle; this router just sent it 1,100 uncached tokens.
    engines = [engine("h", matched_blocks=PREFIX_BLOCKS, own_prefilling=2,
                      own_prefill_tokens=1100, in_flight=2), engine("o")]
    assert ttft(engines) == {"h": 1.132, "o": 1.056}
    assert ranked(engines, EXACT) == ["o", "h"]
    # Streams past their first token are decodes: 6 in flight, 2 of them prefilling.
    engines = [engine("h", matched_blocks=PREFIX_BLOCKS, in_flight=6, own_prefilling=2)]
    assert ttft(engines) == {"h": 0.072}  # 32 tokens + 4 decodes


def test_kv_pressure_penalises_new_blocks_not_hits() -> None:
    # A new prefix: the hash winner at 95% KV usage pays (1 + 2 x 0.5) x 544 tokens.
    engines = [engine(HASH_FIRST, kv_cache_usage=0.95), engine(HASH_SECOND)]
    assert ttft(engines) == {HASH_FIRST: 1.088, HASH_SECOND: 0.544}
    assert ranked(engines) == [HASH_SECOND, HASH_FIRST]
    assert reason(engines) == "least_load"
    # Below the threshold usage is free; a cached prompt adds only its suffix under pressure.
    engines = [engine(HASH_FIRST, kv_cache_usage=0.9), engine(HASH_SECOND)]
    assert ranked(engines) == [HASH_FIRST, HASH_SECOND]
    engines = [engine("h", matched_blocks=PREFIX_BLOCKS, kv_cache_usage=0.99), engine("o")]
    assert ttft(engines)["h"] == pytest.approx((32 * (1 + 2 * 0.9)) / 1000)
    assert ranked(engines) == ["h", "o"]


def test_engines_without_rates_are_ranked_with_defaults_or_the_fleets_rates() -> None:
    old = dict(rate=0.0, step=0.0, queued_prefill_tokens=-1, num_decoding=-1)
    # Nobody publishes: 1000 tokens/s, 10 ms per decode; queued = num_waiting prompts.
    engines = [engine("h", matched_blocks=PREFIX_BLOCKS, num_running=3, **old),
               engine("o", **old)]
    assert ttft(engines) == {"h": 0.062, "o": 1.056}  # 32 tokens + 3 running
    assert ranked(engines) == ["h", "o"]
    engines = [engine("h", matched_blocks=PREFIX_BLOCKS, num_waiting=1, **old),
               engine("o", **old)]
    assert ttft(engines) == {"h": 0.576, "o": 1.056}
    # A new engine among measured ones takes their mean rate, not the default: equal
    # estimates, so the hash decides, as between two measured engines.
    engines = [engine(HASH_FIRST, rate=0.0, step=0.0), engine(HASH_SECOND, rate=4000.0)]
    assert ttft(engines) == {HASH_FIRST: 0.136, HASH_SECOND: 0.136}
    assert ranked(engines) == [HASH_FIRST, HASH_SECOND]


def test_host_hits_cost_their_copy_and_pending_hits_nothing() -> None:
    engines = [engine("device", matched_blocks=8), engine("host", matched_host_blocks=8),
               engine("pending", matched_pending_blocks=8)]
    # Device and pending: 544 - 128; host: + 0.5 x 128 for the copy.
    assert ttft(engines) == {"device": 0.416, "host": 0.48, "pending": 0.416}


def test_replicas_rank_alike_whatever_the_input_order() -> None:
    engines = [engine("a", matched_blocks=4, queued_prefill_tokens=100), engine("b"),
               engine("c", matched_pending_blocks=4, queued_prefill_tokens=100)]
    orders = {tuple(ranked(order)) for order in
              (engines, engines[::-1], engines[1:] + engines[:1], engines[2:] + engines[:2])}
    assert len(orders) == 1
    # a and c cost the same: the hash, not the input order, decides between them.
    a_c = sorted("ac", key=lambda i: -rendezvous_weight(KEY, i))
    assert list(orders.pop()) == [*a_c, "b"]


def test_other_policies_keep_their_rankings_and_reasons() -> None:
    engines = [engine("a", num_running=2), engine("b", num_running=1)]
    for policy in (Policy.LEAST_LOAD, Policy.ROUND_ROBIN):
        ranking = rank(policy, engines, tie_key=KEY, counter=0, config=DEFAULT, shape=SHAPE)
        assert choice_reason(policy, ranking, DEFAULT, SHAPE) == policy.value
    assert [e.engine_id for e in rank(Policy.LEAST_LOAD, engines, tie_key=KEY, counter=0,
                                      config=DEFAULT)] == ["b", "a"]


class _Store:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, int, float]] = []

    async def mark_pending(self, engine_id: str, epoch: str, hashes: Sequence[bytes],
                           ttl_s: float) -> None:
        await asyncio.sleep(0.01)  # a slow write: the removal must still come after it
        self.calls.append(("mark", engine_id, epoch, len(hashes), ttl_s))

    async def unmark_pending(self, engine_id: str, epoch: str, hashes: Sequence[bytes]) -> None:
        self.calls.append(("unmark", engine_id, epoch, len(hashes), 0.0))


def test_claims_write_what_the_engine_lacks_and_release_in_order() -> None:
    hashes = [bytes([i]) * 16 for i in range(33)]
    engines = [engine("h", matched_blocks=10, matched_host_blocks=2), engine("o"),
               EngineView("no-epoch", "x:1")]
    estimates = estimate_all(engines, SHAPE, DEFAULT)
    store = _Store()

    async def run() -> None:
        claims = PendingClaims(store, hashes, estimates, PendingConfig(2.0, 3.0))
        assert claims.uncached_tokens("h") == 544 - 12 * 16
        for view in engines:
            claims.claim(view)
        claims.release(engines[1])
        claims.release(engines[2])  # never claimed: nothing to undo
        await drain()

    asyncio.run(run())
    assert store.calls == [
        ("mark", "h", "e1", 21, pytest.approx(2.0 + 3.0 * estimates["h"].ttft_s)),
        ("mark", "o", "e1", 33, pytest.approx(2.0 + 3.0 * estimates["o"].ttft_s)),
        ("unmark", "o", "e1", 33, 0.0),
    ]


def test_tied_new_prefixes_go_by_counted_work_not_by_the_estimates_noise() -> None:
    # Estimates within the tolerance are equal: 91% KV usage costs HASH_FIRST 20% more
    # (0.653 s against 0.544), yet with nothing queued on either, the hash decides.
    engines = [engine(HASH_FIRST, kv_cache_usage=0.91), engine(HASH_SECOND)]
    assert ttft(engines) == {HASH_FIRST: 0.65280, HASH_SECOND: 0.544}
    assert ranked(engines) == [HASH_FIRST, HASH_SECOND]
    assert reason(engines) == "hash"
    # Counted work does decide a tie: 200 prompt tokens queued on HASH_FIRST against 100
    # (0.744 s against 0.644: tied), and its fewer requests do not outweigh them.
    engines = [engine(HASH_FIRST, queued_prefill_tokens=200),
               engine(HASH_SECOND, num_running=3, num_waiting=1, queued_prefill_tokens=100)]
    assert ranked(engines) == [HASH_SECOND, HASH_FIRST]
    assert reason(engines) == "least_load"
