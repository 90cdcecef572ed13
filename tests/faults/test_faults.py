"""The fault suite: real processes, real Redis, tiny model, bounded in time.

Each test injects one fault under light load and asserts what clients saw (no request hung
past the deadlines, none lost, failures carry a clear status and message), that requests
succeed again, and that every engine ends with no request running and every KV block free.
`make chaos` runs the same scenarios under heavier load and prints a table.
"""

from __future__ import annotations

import pytest

from kvfleet.fleet import Fleet
from tests.faults import scenarios
from tests.faults.load import LoadConfig

pytestmark = pytest.mark.slow

LIGHT = LoadConfig(concurrency=3, max_tokens=48, deadline_s=30.0)


def assert_clean(result: scenarios.ScenarioResult) -> None:
    assert result.problems == [], f"{result.name}: {result.row()}"
    counts = result.counts
    assert counts.get("ok", 0) > 0
    for kind in ("hung", "lost", "unclear"):
        assert counts.get(kind, 0) == 0, f"{kind} requests in {result.name}: {result.row()}"


def test_engine_kill9_mid_stream(fleet: Fleet) -> None:
    result = scenarios.engine_kill9(fleet, LIGHT)
    assert_clean(result)
    # Only streams that had started on the killed engine may fail, and they say why.
    for outcome in result.outcomes:
        if outcome.kind == "error":
            assert outcome.code == "UNAVAILABLE" and outcome.first_token is not None


def test_engine_sigstop_then_sigcont(fleet: Fleet) -> None:
    result = scenarios.engine_sigstop(fleet, LIGHT)
    assert_clean(result)
    for outcome in result.outcomes:
        if outcome.kind == "error":
            # After the first token the stall deadline ends the stream, naming the stall.
            assert outcome.first_token is not None
            assert "stall" in outcome.message.lower(), outcome.message


def test_redis_kill_and_restart(fleet: Fleet) -> None:
    result = scenarios.redis_restart(fleet, LIGHT)
    assert_clean(result)
    assert result.counts.get("error", 0) == 0  # load-only routing while Redis is away


def test_tokenizer_kill_and_restart(fleet: Fleet) -> None:
    result = scenarios.tokenizer_restart(fleet, LIGHT)
    assert_clean(result)
    # Streams in flight do not need the tokenizer: none of them fails.
    for outcome in result.outcomes:
        if outcome.kind == "error":
            assert outcome.first_token is None and outcome.code == "UNAVAILABLE"


def test_burst_of_500_requests_all_succeed(fleet: Fleet) -> None:
    result = scenarios.burst(fleet, LIGHT, num_requests=500)
    assert_clean(result)
    assert result.counts == {"ok": 500}


def test_clients_that_vanish_free_their_blocks(fleet: Fleet) -> None:
    result = scenarios.vanishing_clients(fleet, LIGHT)
    assert_clean(result)


def test_router_sigterm_mid_stream(fleet: Fleet) -> None:
    """Last: it replaces the router."""
    result = scenarios.router_sigterm(fleet, LIGHT)
    assert_clean(result)
