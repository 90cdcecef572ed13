"""One request through a real fleet is one trace across router, tokenizer and engine.

The test runs its own OTLP/gRPC receiver (opentelemetry-proto's TraceService) and points
the services at it with the standard OTEL_* variables; the client sends a W3C
`traceparent`, and every service's spans must arrive under that trace id, correctly
parented, with the engine's gen_ai.* attributes and request events. The services log JSON
lines (KVFLEET_LOG_FORMAT=json): the router's line for the request carries its ids.
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from kvfleet.fleet import Fleet
from kvfleet.router_client import build_request
from kvfleet.runtime.tracing import tracing_enabled
from kvfleet.v1 import router_pb2_grpc
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.otlp import ReceivedSpan, Receiver, otlp_env
from tests.fixtures.router_fleet import greedy, wait_until

pytestmark = pytest.mark.timeout(180)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def fleet_options(receiver: tuple[Receiver, int]) -> FleetOptions:
    return {
        "num_engines": 1, "engine_threads": 1, "log_level": "DEBUG",
        "env": {**otlp_env(receiver[1]), "KVFLEET_LOG_FORMAT": "json"},
    }


def test_enabled_only_by_otel_environment() -> None:
    assert not tracing_enabled({})
    assert tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert tracing_enabled({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing_enabled({"OTEL_TRACES_EXPORTER": "none",
                                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert not tracing_enabled({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})


def test_one_trace_across_router_tokenizer_engine(
    fleet: Fleet, receiver: tuple[Receiver, int]
) -> None:
    collector = receiver[0]
    request = build_request(
        "hello tracing", params=greedy(max_tokens=4, ignore_eos=True), request_id="traced-1"
    )
    metadata = (("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"),)
    with grpc.insecure_channel(fleet.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        responses = list(stub.Generate(request, metadata=metadata, timeout=60))
    assert responses[-1].finish_reason == "length"

    def complete() -> list[ReceivedSpan] | None:
        spans = collector.of_trace(TRACE_ID)
        services = {s.service for s in spans}
        wanted = {"kvfleet-router", "kvfleet-tokenizer", "kvfleet-engine"}
        return spans if wanted <= services and len(spans) >= 5 else None

    spans = wait_until(complete, timeout_s=20, what="spans from all three services")
    by_name = {s.name: s for s in spans}
    router = by_name["kvfleet.v1.Router/Generate"]
    assert router.service == "kvfleet-router"
    assert router.parent_span_id == CLIENT_SPAN_ID
    assert router.attributes["kvfleet.tenant"] == "anonymous"
    assert router.attributes["kvfleet.routing.engine_id"] == "engine-0"
    assert "kvfleet.routing.predicted_cached_tokens" in router.attributes
    assert router.attributes["kvfleet.routing.reason"] in {"hash", "least_load", "cached"}
    assert router.attributes["kvfleet.routing.prediction_error_tokens"] == (
        router.attributes["kvfleet.routing.predicted_cached_tokens"]
        - router.attributes["kvfleet.cached_tokens"]
    )
    for child in ("tokenize", "route"):
        assert by_name[child].parent_span_id == router.span_id
    tokenize_rpc = by_name["kvfleet.v1.Tokenizer/Tokenize"]
    assert tokenize_rpc.service == "kvfleet-tokenizer"
    assert tokenize_rpc.parent_span_id == by_name["tokenize"].span_id
    # The engine detokenizes its own output: the tokenizer serves Tokenize only.
    assert {s.name for s in spans if s.service == "kvfleet-tokenizer"} == {
        "kvfleet.v1.Tokenizer/Tokenize"
    }

    engine = by_name["kvfleet.v1.Engine/Generate"]
    assert engine.service == "kvfleet-engine"
    assert engine.parent_span_id == router.span_id
    assert engine.events[0] == "queued" and engine.events[-1] == "finished"
    assert {"scheduled", "first_token"} <= set(engine.events)
    attributes = engine.attributes
    assert attributes["gen_ai.usage.completion_tokens"] == 4
    assert attributes["gen_ai.usage.prompt_tokens"] > 0
    assert attributes["gen_ai.request.max_tokens"] == 4
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.request.top_p"] == 1.0
    for name in ("time_in_queue", "time_to_first_token", "e2e"):
        assert attributes[f"gen_ai.latency.{name}"] >= 0.0
    assert attributes["gen_ai.latency.e2e"] >= attributes["gen_ai.latency.time_to_first_token"]


def test_json_log_lines_carry_request_and_trace_ids(
    fleet: Fleet, receiver: tuple[Receiver, int]
) -> None:
    # Runs after test_one_trace_across_router_tokenizer_engine (file order), which sent
    # request "traced-1".
    assert fleet.router is not None
    lines = fleet.router.log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records, "the router logged no JSON lines"
    assert all({"ts", "level", "logger", "message"} <= r.keys() for r in records)
    mine = [r for r in records if r.get("request_id") == "traced-1"]
    assert mine, "no log line carries the request id"
    assert all(r["tenant"] == "anonymous" and r["trace_id"] == TRACE_ID for r in mine)


def test_http_traceparent_joins_the_callers_trace(
    fleet: Fleet, receiver: tuple[Receiver, int]
) -> None:
    collector = receiver[0]
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    body = json.dumps({"prompt": "hello over http", "max_tokens": 3, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(
        f"{fleet.http_url}/v1/completions", data=body,
        headers={"Content-Type": "application/json",
                 "traceparent": f"00-{trace_id}-{CLIENT_SPAN_ID}-01"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert json.loads(reply.read())["usage"]["completion_tokens"] == 3

    def complete() -> list[ReceivedSpan] | None:
        spans = collector.of_trace(trace_id)
        services = {s.service for s in spans}
        names = {s.name for s in spans}
        ready = {"kvfleet-router", "kvfleet-engine"} <= services and "POST /v1/completions" in names
        return spans if ready else None

    spans = wait_until(complete, timeout_s=20, what="router and engine spans of the HTTP call")
    by_name = {s.name: s for s in spans}
    servers = [s for s in spans if s.name == "POST /v1/completions"]
    assert len(servers) == 1, "one server span per HTTP request (FastAPI's own is off)"
    http = servers[0]
    assert http.parent_span_id == CLIENT_SPAN_ID
    assert http.attributes["kvfleet.tenant"] == "anonymous"
    assert by_name["kvfleet.v1.Engine/Generate"].parent_span_id == http.span_id
