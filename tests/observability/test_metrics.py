"""Prometheus /metrics of a real fleet, scraped over HTTP and parsed with prometheus_client.

One engine with a tiny KV pool (20 blocks of 16 tokens) so that concurrent requests are
preempted; a prompt sent twice gives prefix-cache hits. Counters and histograms of the
engine, router and tokenizer must move exactly as the requests imply.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.fleet import Fleet, ServiceProcess
from kvfleet.router_client import build_request
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import RouterClient, greedy, tenant_prefix

pytestmark = pytest.mark.timeout(180)

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_CONCURRENT = 8
MAX_TOKENS = 24
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 1,
        "engine_args": ("--num-kv-blocks", "20", "--max-num-batched-tokens", "64"),
        "engine_threads": 1,
        "metrics": True,
    }


def scrape(service: ServiceProcess) -> Samples:
    url = f"http://127.0.0.1:{service.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


@contextlib.contextmanager
def engine_held(engine: ServiceProcess) -> Iterator[None]:
    """The engine process stopped (SIGSTOP) for the block: requests sent meanwhile meet in it
    together when it resumes, however slowly a loaded machine delivers them."""
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(engine.pid, signal.SIGCONT)


def wait_for_streams(router: ServiceProcess, count: int) -> None:
    """Until the router is opening its `count`-th stream to the engine, for at most 2 s: a
    stopped engine's heartbeat goes stale after 3 s, and three or more requests held together
    already overflow the pool. The gauge is set as each request is routed, to the streams
    already open, so the last request's routing shows `count - 1`."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if value(scrape(router), "kvfleet:router_engine_in_flight") >= count - 1:
            return
        time.sleep(0.01)


def test_metrics_move_with_requests(fleet: Fleet) -> None:
    engine, router, tokenizer = fleet.engines[0], fleet.router, fleet.tokenizer
    assert router is not None and tokenizer is not None
    before = scrape(engine)
    assert value(before, "kvfleet:num_requests_running") == 0
    assert value(before, "kvfleet:time_to_first_token_seconds_count") == 0

    params = greedy(max_tokens=MAX_TOKENS, ignore_eos=True)
    with grpc.insecure_channel(fleet.router_address) as channel:
        client = RouterClient(channel)
        # The same prompt twice: the second one is served from the prefix cache.
        shared = tenant_prefix(0, num_tokens=64)
        for _ in range(2):
            assert client.generate_ids(shared, None, params).finish_reason == "length"
        # A text prompt goes through the tokenizer's Tokenize.
        text = client.generate(build_request("hello metrics", params=params))
        assert text.finish_reason == "length"
        # Concurrent long prompts do not fit the 20-block pool together: preemptions.
        prompts = [tenant_prefix(i, num_tokens=120) for i in range(1, NUM_CONCURRENT + 1)]
        with concurrent.futures.ThreadPoolExecutor(NUM_CONCURRENT) as pool:
            with engine_held(engine):
                futures = [pool.submit(client.generate_ids, p, None, params) for p in prompts]
                wait_for_streams(router, NUM_CONCURRENT)
            results = [f.result() for f in futures]
        assert all(r.finish_reason == "length" for r in results)
    num_requests = 3 + NUM_CONCURRENT

    after = scrape(engine)
    assert value(after, "kvfleet:time_to_first_token_seconds_count") == num_requests
    assert value(after, "kvfleet:e2e_request_latency_seconds_count") == num_requests
    assert value(after, "kvfleet:request_queue_time_seconds_count") == num_requests
    assert value(after, "kvfleet:inter_token_latency_seconds_count") == num_requests * (
        MAX_TOKENS - 1
    )
    assert value(after, "kvfleet:request_success_total", finished_reason="length") == (
        num_requests
    )
    assert value(after, "kvfleet:generation_tokens_total") == num_requests * MAX_TOKENS
    assert value(after, "kvfleet:request_generation_tokens_sum") == num_requests * MAX_TOKENS
    assert value(after, "kvfleet:prefix_cache_hits_total") >= 48  # 3 full blocks of 64 - 1
    assert value(after, "kvfleet:prefix_cache_queries_total") >= value(
        after, "kvfleet:prefix_cache_hits_total"
    )
    assert value(after, "kvfleet:num_preemptions_total") > 0
    assert value(after, "kvfleet:iteration_tokens_total_count") > 0
    assert value(after, "kvfleet:num_requests_running") == 0
    assert 0.0 <= value(after, "kvfleet:kv_cache_usage_perc") <= 1.0

    routed = scrape(router)
    assert value(routed, "kvfleet:router_requests_total", tenant="anonymous", code="OK") == (
        num_requests
    )
    assert value(routed, "kvfleet:router_routing_decisions_total", engine_id="engine-0") == (
        num_requests
    )
    assert value(routed, "kvfleet:router_actual_cached_tokens_total") >= 48
    assert value(routed, "kvfleet:router_cached_tokens_drift_count") == num_requests
    assert value(routed, "kvfleet:router_redis_latency_seconds_count") >= num_requests
    # Every request was held on its engine from its decision to its send.
    assert value(routed, "kvfleet:router_decision_hold_seconds_count") == num_requests
    assert value(routed, "kvfleet:router_redis_errors_total") == 0
    assert ("kvfleet:router_engine_num_running", frozenset({("engine_id", "engine-0")})) in routed

    tokenized = scrape(tokenizer)
    assert value(tokenized, "kvfleet:tokenizer_requests_total", method="Tokenize", code="OK") == 1
    # Engines stream text already detokenized: no tokenizer call per generated token.
    assert value(tokenized, "kvfleet:tokenizer_requests_total", method="DetokenizeStream") == 0
    assert value(tokenized, "kvfleet:tokenizer_requests_total", method="Detokenize") == 0
    assert value(
        tokenized, "kvfleet:tokenizer_request_duration_seconds_count", method="Tokenize"
    ) == 1


def test_router_counts_failed_requests(fleet: Fleet) -> None:
    router = fleet.router
    assert router is not None
    before = value(scrape(router), "kvfleet:router_requests_total", code="INVALID_ARGUMENT")
    with grpc.insecure_channel(fleet.router_address) as channel:
        client = RouterClient(channel)
        with pytest.raises(grpc.RpcError) as info:
            client.generate_ids([], None)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    after = value(scrape(router), "kvfleet:router_requests_total", code="INVALID_ARGUMENT")
    assert after == before + 1


def test_dashboard_uses_only_served_metrics(fleet: Fleet) -> None:
    # After the requests above, every series the dashboard queries exists somewhere.
    served = {
        name
        for service in (fleet.engines[0], fleet.router, fleet.tokenizer)
        if service is not None
        for name, _ in scrape(service)
    }
    dashboard = (REPO_ROOT / "docs" / "grafana" / "kvfleet-dashboard.json").read_text()
    json.loads(dashboard)
    used = set(re.findall(r"kvfleet:[a-z0-9_]+", dashboard))
    assert used and used <= served, sorted(used - served)
