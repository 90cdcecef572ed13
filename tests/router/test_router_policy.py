"""Routing policies, auth and stop strings as pure functions: exact expected choices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.text.stop_strings import StopStringMatcher
from router.routing.ranking import (
    EngineView,
    Policy,
    PrefixPolicyConfig,
    rank,
    rank_least_load,
    rank_prefix,
    rank_round_robin,
    rendezvous_weight,
)
from router.tenancy.api_keys import (
    ANONYMOUS_TENANT,
    AuthenticationError,
    Authenticator,
)
from router.tenancy.tenant_policy import load_api_keys

# The cost model by time alone (no duplicate charge, no tie tolerance): engines here publish
# no rates, so the defaults apply, 1000 prompt tokens/s and 10 ms per decoding request;
# queued work is num_waiting prompts like this one. (The count-based load bound these tests
# once pinned is gone; its cases below now state what the cost model decides. The defaults
# and the rest: tests/router/test_ttft_routing.py.)
BOUND = PrefixPolicyConfig(duplicate_weight=0.0, tie_rel=0.0, tie_abs_s=0.0)
KEY = b"tie-key"


def view(engine_id: str, matched: int = 0, running: int = 0, waiting: int = 0,
         usage: float = 0.0, in_flight: int = 0) -> EngineView:
    return EngineView(engine_id, f"{engine_id}:1", matched, running, waiting, usage, in_flight)


def by_weight(*engine_ids: str) -> list[str]:
    """Engine ids in rendezvous order for KEY (highest weight first)."""
    return sorted(engine_ids, key=lambda i: -rendezvous_weight(KEY, i))


def ids(ranking: list[EngineView]) -> list[str]:
    return [e.engine_id for e in ranking]


def test_prefix_prefers_the_engine_holding_the_prefix() -> None:
    engines = [view("a", matched=0), view("b", matched=32), view("c", matched=8)]
    assert ids(rank_prefix(engines, KEY, BOUND)) == ["b", "c", "a"]


def test_prefix_hit_loses_to_a_shorter_wait_elsewhere() -> None:
    # Prompt 528 tokens (33 blocks); b holds 32. b: one waiting 528-token prompt + 16 own
    # tokens + 3 decodes = 0.574 s; a recomputes all 528 tokens = 0.528 s.
    engines = [view("a", running=0), view("b", matched=32, running=3, waiting=1)]
    assert ids(rank_prefix(engines, KEY, BOUND)) == ["a", "b"]


def test_hot_prefix_stays_while_recomputing_it_costs_more() -> None:
    # b is 5 requests busier, but 5 decodes (0.05 s) + 16 tokens cost less than 528 tokens.
    engines = [view("a", running=0), view("b", matched=32, running=5)]
    assert ids(rank_prefix(engines, KEY, BOUND)) == ["b", "a"]


def test_waiting_prompts_weigh_by_their_work_not_their_count() -> None:
    # 20 decodes each (0.2 s); b's 9 more running cost 0.09 s < recomputing 160 tokens, but
    # one waiting 176-token prompt on b (0.176 s) tips it to a.
    near = [view("a", running=20), view("b", matched=10, running=29)]
    far = [view("a", running=20), view("b", matched=10, running=20, waiting=1)]
    assert ids(rank_prefix(near, KEY, BOUND)) == ["b", "a"]
    assert ids(rank_prefix(far, KEY, BOUND)) == ["a", "b"]


def test_local_in_flight_counts_when_redis_lags() -> None:
    # Redis says b is idle, but this router has 40 requests streaming from it (0.4 s of
    # decode steps) against 528 - 16 tokens to recompute on a (0.512 s): b still; at 60, a.
    engines = [view("a"), view("b", matched=32, in_flight=40)]
    assert ids(rank_prefix(engines, KEY, BOUND)) == ["b", "a"]
    engines = [view("a"), view("b", matched=32, in_flight=60)]
    assert ids(rank_prefix(engines, KEY, BOUND)) == ["a", "b"]


def test_equal_hits_go_to_the_lower_load() -> None:
    engines = [view("a", matched=6, running=3), view("b", matched=6, running=1), view("c")]
    assert ids(rank_prefix(engines, KEY, BOUND)) == ["b", "a", "c"]


def test_a_new_prefix_follows_the_hash_only_among_equal_costs() -> None:
    # Equal estimates: the hash decides. A busier engine costs more (the second request of
    # the prefix then follows the first through its pending entries, not through the hash).
    first, second = by_weight("a", "b")
    engines = [view("a"), view("b")]
    assert ids(rank_prefix(engines, KEY, BOUND)) == [first, second]
    engines = [view(first, running=3), view(second)]
    assert ids(rank_prefix(engines, KEY, BOUND)) == [second, first]


def test_a_new_prefix_avoids_the_busier_engine() -> None:
    first, second = by_weight("a", "b")
    engines = [view(first, running=5), view(second)]
    assert ids(rank_prefix(engines, KEY, BOUND)) == [second, first]


def test_full_ties_are_the_same_for_any_input_order() -> None:
    engines = [view("a"), view("b"), view("c")]
    assert ids(rank_prefix(engines, KEY, BOUND)) == by_weight("a", "b", "c")
    assert ids(rank_prefix(engines[::-1], KEY, BOUND)) == by_weight("a", "b", "c")
    other_key = sorted("abc", key=lambda i: -rendezvous_weight(b"other", i))
    assert ids(rank_prefix(engines, b"other", BOUND)) == other_key


def test_least_load_orders_by_load_then_kv_usage() -> None:
    engines = [view("a", running=2), view("b", running=1, usage=0.5), view("c", running=1)]
    assert ids(rank_least_load(engines, KEY)) == ["c", "b", "a"]


def test_round_robin_rotates_by_counter() -> None:
    engines = [view("b"), view("a"), view("c")]
    assert [ids(rank_round_robin(engines, n))[0] for n in range(4)] == ["a", "b", "c", "a"]


def test_every_policy_returns_a_permutation() -> None:
    engines = [view("a", matched=3, running=9), view("b", usage=0.9), view("c", running=1)]
    for policy in Policy:
        ranking = rank(policy, engines, tie_key=KEY, counter=7, config=BOUND)
        assert sorted(ids(ranking)) == ["a", "b", "c"]
    assert rank(Policy.PREFIX, [], tie_key=KEY, counter=0, config=BOUND) == []


def test_auth_maps_keys_to_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"acme": ["k1", "k2"]}, "keys": {"k3": "solo"}}))
    auth = load_api_keys(path)
    assert auth.tenant_for([("authorization", "Bearer k2")]) == "acme"
    assert auth.tenant_for([("x-api-key", "k3")]) == "solo"
    with pytest.raises(AuthenticationError, match="invalid API key"):
        auth.tenant_for([("x-api-key", "nope")])
    with pytest.raises(AuthenticationError, match="missing API key"):
        auth.tenant_for([])
    assert Authenticator().tenant_for([("x-api-key", "anything")]) == ANONYMOUS_TENANT


def test_auth_yaml_and_bad_files(tmp_path: Path) -> None:
    yaml_file = tmp_path / "keys.yaml"
    yaml_file.write_text("tenants:\n  t1: [a-key]\n")
    assert load_api_keys(yaml_file).tenant_for([("x-api-key", "a-key")]) == "t1"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"keys": {"k": "t1"}, "tenants": {"t2": ["k"]}}))
    with pytest.raises(ValueError, match="two tenants"):
        load_api_keys(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="tenants"):
        load_api_keys(bad)


def test_stop_strings_hold_back_and_cut() -> None:
    matcher = StopStringMatcher(["END", "\n\n"])
    assert matcher.add("Hello E") == "Hello"  # "E" may start "END"
    assert matcher.add("N") == " "
    assert matcher.add("Dmore") == ""
    assert matcher.matched == "END"
    assert matcher.add("x") == ""


def test_stop_string_included_and_min_tokens_semantics() -> None:
    matcher = StopStringMatcher(["stop"], include_stop_str_in_output=True)
    assert matcher.add("a stop b") == "a stop"
    unchecked = StopStringMatcher(["ab"])
    # An occurrence before min_tokens is plain text and never matches later.
    assert unchecked.add("xab", check=False) + unchecked.add("c") + unchecked.flush() == "xabc"
    assert unchecked.matched is None
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        StopStringMatcher(["ok", ""])
