"""End to end: what a fleet exports to a real OTLP receiver holds no API key, no router
secret and no prompt text (docs/security.md, issue 38 finding 5).

A fleet with API keys (router, tokenizer, one engine as processes, the router holding the
secret engines require) exports to the OTLP/gRPC receiver of tests/fixtures/otlp.py. One chat
over HTTP and one completion over gRPC, each with a canary prompt and a key and a known
trace id, are served; every span of both traces, from all three services, is searched: span
names, attributes, events and event attributes. The unit-level twin (in-memory exporter, the
--trace-prompts opt-in) is tests/observability/test_span_privacy.py.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import grpc
import pytest

from kvfleet.fleet import Fleet
from kvfleet.router_client import build_request
from kvfleet.runtime.service_auth import read_secret
from kvfleet.v1 import router_pb2_grpc
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.otlp import ReceivedSpan, Receiver, otlp_env
from tests.fixtures.router_fleet import API_KEYS, greedy, wait_until

pytestmark = pytest.mark.timeout(180)

KEY = API_KEYS["tenant-0"]
CANARY = "zebra canary prompt 4417"
HTTP_TRACE, GRPC_TRACE = "6bf92f3577b34da6a3ce929d0e0e4738", "7bf92f3577b34da6a3ce929d0e0e4739"
PARENT_SPAN = "00f067aa0ba902b7"
SERVICES = {"kvfleet-router", "kvfleet-tokenizer", "kvfleet-engine"}


@pytest.fixture(scope="module")
def fleet_options(receiver: tuple[Receiver, int]) -> FleetOptions:
    return {"num_engines": 1, "engine_threads": 1, "api_keys": True,
            "env": otlp_env(receiver[1])}


def traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{PARENT_SPAN}-01"


def spans_of(collector: Receiver, trace_id: str) -> list[ReceivedSpan]:
    def complete() -> list[ReceivedSpan] | None:
        spans = collector.of_trace(trace_id)
        # The request's own span (it names the tenant) ends, and is exported, last.
        ended = any("kvfleet.tenant" in s.attributes for s in spans)
        return spans if ended and {s.service for s in spans} >= SERVICES else None

    return wait_until(complete, timeout_s=30, what=f"spans of all services in {trace_id}")


def exported_strings(span: ReceivedSpan) -> list[str]:
    values: list[Any] = [span.name, *span.attributes.values(), *span.events]
    for attributes in span.event_attributes:
        values += list(attributes.values())
    return [json.dumps(v) if isinstance(v, list) else str(v) for v in values]


def test_spans_carry_no_key_secret_or_prompt(fleet: Fleet,
                                             receiver: tuple[Receiver, int]) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": CANARY}], "max_tokens": 3,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{fleet.http_url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {KEY}",
                                              "traceparent": traceparent(HTTP_TRACE)})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert json.loads(reply.read())["usage"]["completion_tokens"] == 3
    with grpc.insecure_channel(fleet.router_address) as channel:
        generate = router_pb2_grpc.RouterStub(channel).Generate(
            build_request(CANARY, params=greedy(max_tokens=3, ignore_eos=True)), timeout=60,
            metadata=(("x-api-key", KEY), ("traceparent", traceparent(GRPC_TRACE))))
        assert list(generate)[-1].finish_reason == "length"

    secret = read_secret(fleet.router_secret_file)
    forbidden = (KEY, f"Bearer {KEY}", secret, CANARY, "zebra")
    for trace_id in (HTTP_TRACE, GRPC_TRACE):
        spans = spans_of(receiver[0], trace_id)
        assert {"tenant-0"} == {s.attributes["kvfleet.tenant"] for s in spans
                                if "kvfleet.tenant" in s.attributes}
        for span in spans:
            for text in exported_strings(span):
                leaked = [f for f in forbidden if f in text]
                assert not leaked, (span.service, span.name, text)
