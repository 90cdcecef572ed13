"""Bytes that are not the request message: INVALID_ARGUMENT on every service, and it keeps serving.

Real processes (Redis, tokenizer, one engine, router) over real sockets. A raw channel sends
undecodable bytes (a truncated varint; invalid UTF-8 in a string field) to each kind of
method: unary (Tokenize, GetLoad, health Check), server-streaming (Engine and Router
Generate) and bidirectional streaming (DetokenizeStream, reflection).
"""

from __future__ import annotations

import grpc
import pytest

from kvfleet.fleet import Fleet
from kvfleet.router_client import build_request
from kvfleet.runtime.service_auth import CREDENTIAL_HEADER
from kvfleet.v1 import tokenizer_pb2
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import RouterClient, greedy

pytestmark = pytest.mark.timeout(180)

TRUNCATED = b"\x0a\xff\xff\xff"  # field 1, length-delimited, length varint never ends
BAD_UTF8 = b"\x0a\x02\xff\xfe"  # field 1 (a string in every request below) = 0xff 0xfe


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 1, "engine_args": ("--num-kv-blocks", "64"),
    }


def _addresses(fleet: Fleet) -> dict[str, str]:
    assert fleet.tokenizer is not None
    return {"tokenizer": fleet.tokenizer.address, "engine": fleet.engines[0].address,
            "router": fleet.router_address}


# (service, method, kind)
METHODS = [
    ("tokenizer", "/kvfleet.v1.Tokenizer/Tokenize", "unary"),
    ("tokenizer", "/kvfleet.v1.Tokenizer/DetokenizeStream", "bidi"),
    ("tokenizer", "/grpc.health.v1.Health/Check", "unary"),
    ("engine", "/kvfleet.v1.Engine/Generate", "server_stream"),
    ("engine", "/kvfleet.v1.Engine/Abort", "unary"),
    ("engine", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "bidi"),
    ("router", "/kvfleet.v1.Router/Generate", "server_stream"),
    ("router", "/grpc.health.v1.Health/Check", "unary"),
]


def _call(channel: grpc.Channel, method: str, kind: str, payload: bytes,
          metadata: tuple[tuple[str, str], ...] = ()) -> None:
    if kind == "unary":
        channel.unary_unary(method)(payload, timeout=10, metadata=metadata)
    elif kind == "server_stream":
        list(channel.unary_stream(method)(payload, timeout=10, metadata=metadata))
    else:
        list(channel.stream_stream(method)(iter([payload]), timeout=10, metadata=metadata))


@pytest.mark.parametrize("payload", [TRUNCATED, BAD_UTF8], ids=["truncated", "bad-utf8"])
@pytest.mark.parametrize(("service", "method", "kind"), METHODS)
def test_undecodable_request_is_invalid_argument(
    fleet: Fleet, service: str, method: str, kind: str, payload: bytes
) -> None:
    # Engines check the router credential before decoding: send it, so decoding is what fails.
    metadata = ((CREDENTIAL_HEADER, fleet.router_secret_file.read_text()),) \
        if service == "engine" else ()
    with grpc.insecure_channel(_addresses(fleet)[service]) as channel, \
            pytest.raises(grpc.RpcError) as info:
        _call(channel, method, kind, payload, metadata)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    details = info.value.details() or ""
    assert "could not be decoded" in details and "<class" not in details


def test_services_keep_serving_after_garbage(fleet: Fleet) -> None:
    assert fleet.tokenizer is not None
    with grpc.insecure_channel(fleet.tokenizer.address) as channel:
        with pytest.raises(grpc.RpcError):
            _call(channel, "/kvfleet.v1.Tokenizer/Tokenize", "unary", TRUNCATED)
        tokenize = channel.unary_unary(
            "/kvfleet.v1.Tokenizer/Tokenize",
            request_serializer=tokenizer_pb2.TokenizeRequest.SerializeToString,
            response_deserializer=tokenizer_pb2.TokenizeResponse.FromString,
        )
        assert tokenize(tokenizer_pb2.TokenizeRequest(text="hello"), timeout=10).token_ids
    with grpc.insecure_channel(fleet.router_address) as channel:
        with pytest.raises(grpc.RpcError):
            _call(channel, "/kvfleet.v1.Router/Generate", "server_stream", TRUNCATED)
        result = RouterClient(channel).generate(build_request(prompt="hi", params=greedy(3)))
        assert result.finish_reason
