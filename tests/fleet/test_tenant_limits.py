"""Tenant policy end to end on a real fleet: Redis, tokenizer, one engine, two routers.

Limits are chosen so no verdict depends on timing: a request rate of one per 10,000 s
refills nothing during a test, so "the burst is spent" stays true however slow the machine.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvfleet.fleet import Fleet, ServiceProcess
from kvfleet.router_client import build_request
from kvfleet.runtime.service_auth import CREDENTIAL_HEADER
from kvfleet.v1 import engine_pb2, engine_pb2_grpc
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import RouterClient, greedy, wait_until

pytestmark = pytest.mark.timeout(300)

POLICY = {
    "defaults": {"max_choices": 4, "max_tokens": 8},
    "tenants": {
        # Burst 3 for the whole fleet, then nothing for 10,000 s.
        "metered": {"keys": ["key-metered"], "requests_per_second": 0.0001,
                    "request_burst": 3},
        "http-metered": {"keys": ["key-http"], "requests_per_second": 0.0001,
                         "request_burst": 1, "tokens_per_minute": 100000},
        "grpc-metered": {"keys": ["key-grpc"], "requests_per_second": 0.0001,
                         "request_burst": 1},
        "free": ["key-free"],
    },
}


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("policy") / "policy.yaml"
    path.write_text(json.dumps(POLICY))  # JSON is YAML too
    return path


@pytest.fixture(scope="module")
def fleet_options(policy_file: Path) -> FleetOptions:
    return {
        "num_engines": 1, "api_keys": policy_file, "engine_args": ("--num-kv-blocks", "128"),
        "router_args": ("--policy-reload-interval", "0.2"), "routers": [("router-b", "prefix")],
    }


def client_of(router: ServiceProcess) -> RouterClient:
    return RouterClient(grpc.insecure_channel(router.address))


def request(max_tokens: int = 2):  # type: ignore[no-untyped-def]
    return build_request(prompt_token_ids=[5, 6, 7, 8, 9], params=greedy(max_tokens))


def outcome(client: RouterClient, key: str) -> str:
    try:
        client.generate(request(), key)
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def test_the_sum_over_two_routers_is_enforced(fleet: Fleet) -> None:
    a, b = client_of(fleet.router), client_of(fleet.extra_routers[0])
    results = [outcome(client, "key-metered") for client in (a, b, a, b, a)]
    assert results == ["OK", "OK", "OK", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"]
    assert outcome(b, "key-free") == "OK"  # other tenants are not affected


def test_grpc_refusal_carries_the_retry_delay(fleet: Fleet) -> None:
    client = client_of(fleet.router)
    assert outcome(client, "key-grpc") == "OK"
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(request(), "key-grpc")
    error = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(error.trailing_metadata())  # type: ignore[attr-defined]
    assert int(trailers["retry-after"]) > 9000
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    assert info.retry_delay.seconds > 9000


def post(fleet: Fleet, key: str, body: dict[str, object]) -> tuple[int, dict[str, str], dict]:
    req = urllib.request.Request(
        f"{fleet.http_url}/v1/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_http_429_with_openai_rate_limit_headers(fleet: Fleet) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 2}
    status, headers, _ = post(fleet, "key-http", body)
    assert status == 200
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(headers["x-ratelimit-remaining-tokens"]) == 100000 - 4
    status, headers, error = post(fleet, "key-http", body)
    assert status == 429 and error["error"]["type"] == "RateLimitError"
    assert int(headers["retry-after"]) > 9000
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")


def test_per_request_caps(fleet: Fleet) -> None:
    status, _, error = post(fleet, "key-free", {"prompt": [5, 6], "max_tokens": 9})
    assert status == 400 and error["error"]["param"] == "max_tokens"
    status, _, error = post(fleet, "key-free", {"prompt": [[5, 6]] * 3, "n": 2,
                                                 "max_tokens": 2})
    assert status == 400 and "at most 4" in error["error"]["message"]
    # max_tokens unset (chat) takes the tenant's cap of 8 instead of the whole context.
    req = urllib.request.Request(
        f"{fleet.http_url}/v1/chat/completions",
        data=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                         "ignore_eos": True}).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer key-free"},
    )
    with urllib.request.urlopen(req, timeout=60) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 8


def test_metrics_on_the_api_port_name_no_tenant(fleet: Fleet) -> None:
    assert outcome(client_of(fleet.router), "key-free") == "OK"
    with urllib.request.urlopen(f"{fleet.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    assert "kvfleet:router_routing_decisions" in text
    assert "tenant=" not in text and "key-free" not in text and "free" not in text.replace(
        "free_", "")


def test_engines_refuse_callers_without_the_router_credential(fleet: Fleet) -> None:
    engine = fleet.engines[0]
    secret = fleet.router_secret_file.read_text()
    probe = engine_pb2.GenerateRequest(request_id="probe", prompt_token_ids=[5, 6, 7],
                                       cache_salt="metered", sampling_params=greedy(1))
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(probe, timeout=30))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(probe, timeout=30,
                               metadata=[(CREDENTIAL_HEADER, "x" * len(secret))]))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        served = list(stub.Generate(probe, timeout=30, metadata=[(CREDENTIAL_HEADER, secret)]))
        assert served[-1].finish_reason == "length"
        # Load figures stay open to probes and dashboards: no tenant data in them.
        assert stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=30).engine_id == engine.name


def test_policy_reloads_and_a_bad_version_keeps_the_last_good_one(
    fleet: Fleet, policy_file: Path
) -> None:
    client = client_of(fleet.router)
    assert outcome(client, "key-new") == "UNAUTHENTICATED"
    policy = json.loads(json.dumps(POLICY))
    policy["tenants"]["new"] = ["key-new"]
    policy_file.write_text(json.dumps(policy))
    wait_until(lambda: outcome(client, "key-new") == "OK", timeout_s=30)
    policy_file.write_text("tenants:\n  new: {keys: [key-new], weight: -1}\n")
    log = fleet.router.log_path
    wait_until(lambda: "tenants.new.weight" in log.read_text(errors="replace"), timeout_s=30)
    assert outcome(client, "key-new") == "OK"
