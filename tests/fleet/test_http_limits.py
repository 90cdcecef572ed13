"""Bad input costs nobody: the router's limits, its read deadline and its error JSON.

Real processes (Redis, tokenizer, one engine, router) over real sockets, the router with its
default limits except a 2 s body-read deadline, the engine with --max-model-len 256 (below
the tiny model's 512). Driven by the official `openai` SDK and, for what an SDK never sends
(invalid UTF-8, lying Content-Length, trickled bodies), by raw sockets.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.fleet import Fleet, ServiceProcess
from kvfleet.router_client import build_request
from kvfleet.v1 import common_pb2
from router.request_limits import RequestLimits
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import API_KEYS, RouterClient

pytestmark = pytest.mark.timeout(240)

KEY = API_KEYS["tenant-0"]
MAX_MODEL_LEN = 256
READ_DEADLINE_S = 2.0
LIMITS = RequestLimits()
INF = "<1e999>"  # stands for a JSON number too large for a float


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 1,
        "api_keys": True,
        "engine_args": ("--num-kv-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN)),
        "router_args": ("--body-read-timeout", str(READ_DEADLINE_S)),
        "metrics": True,
    }


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> str:
    return tiny_model_dir.name


def _port(fleet: Fleet) -> int:
    assert fleet.router is not None
    return fleet.router.http_port


def _raw(port: int, head: bytes, body_parts: list[bytes] = (), pause_s: float = 0.0,
         read_timeout_s: float = 20.0) -> tuple[int, dict[str, object], float]:
    """Send a raw request (headers, then the body parts `pause_s` apart) and read the reply:
    (status, JSON body, seconds from connecting to the connection closing). The clock starts
    before the connection: the router's read deadline starts when it accepts, which can come
    before create_connection returns here."""
    started = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", port), timeout=read_timeout_s)
    with sock:
        sock.sendall(head)
        for part in body_parts:
            try:
                sock.sendall(part)
            except OSError:
                break  # the server answered and closed
            time.sleep(pause_s)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and _complete(data):
                break
    elapsed = time.monotonic() - started
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1]), elapsed


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _head(path: str, body_len: int | None, extra: str = "") -> bytes:
    length = f"Content-Length: {body_len}\r\n" if body_len is not None else ""
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{length}{extra}\r\n").encode()


def _post_bytes(port: int, path: str, body: bytes) -> tuple[int, dict[str, object]]:
    status, reply, _ = _raw(port, _head(path, len(body)), [body])
    return status, reply


def _error(reply: dict[str, object]) -> dict[str, object]:
    assert set(reply) == {"error"}, reply  # never FastAPI's {"detail": ...}
    error = reply["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert "Error" not in str(error["message"]).split()[0], error  # no Python class names
    return error


def _tokenize_calls(tokenizer: ServiceProcess) -> float:
    url = f"http://127.0.0.1:{tokenizer.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "kvfleet:tokenizer_requests_total"
               and sample.labels.get("method") == "Tokenize")


def test_a_5mb_prompt_is_413_which_the_sdk_does_not_retry(fleet: Fleet, model: str) -> None:
    # The SDK retries 408, 429 and 5xx; a 413 comes straight back to the caller.
    with OpenAI(base_url=f"{fleet.http_url}/v1", api_key=KEY, max_retries=3, timeout=60) as c, \
            pytest.raises(openai.APIStatusError) as info:
        c.completions.create(model=model, prompt="a" * 5_000_000, max_tokens=2)
    assert info.value.status_code == 413
    message = info.value.message
    assert "--payload-limit" in message and "RESOURCE_EXHAUSTED" not in message


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("prompt", {"prompt": "a" * (LIMITS.max_input_chars + 1)}),
        ("messages",
         {"messages": [{"role": "user", "content": "hi"}] * (LIMITS.max_messages + 1)}),
        ("stop", {"prompt": "hi", "stop": [str(i) for i in range(LIMITS.max_stop_sequences + 1)]}),
        ("stop", {"prompt": "hi", "stop": "x" * (LIMITS.max_stop_chars + 1)}),
        ("prompt", {"prompt": ["a", "b", "c"], "n": LIMITS.max_choices // 2}),
        ("tools[0].function.parameters",
         {"messages": [{"role": "user", "content": "hi"}],
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}),
        ("tool_choice", {"messages": [{"role": "user", "content": "hi"}],
                         "tool_choice": "auto"}),
        ("response_format.json_schema.schema",
         {"messages": [{"role": "user", "content": "hi"}],
          "response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}}),
        ("structured_outputs.regex", {"prompt": "hi", "structured_outputs": {"regex": "("}}),
        ("max_tokens", {"prompt": "hi", "max_tokens": 10**20}),
        ("priority", {"prompt": "hi", "priority": 2**40}),
        ("top_k", {"prompt": "hi", "top_k": 2**40}),
        ("prompt", {"prompt": [2**40]}),
        ("temperature", {"prompt": "hi", "temperature": INF}),
        ("messages[0].role", {"messages": [{"role": "robot", "content": "hi"}]}),
    ],
)
def test_over_limit_or_unsupported_is_400_naming_the_field_before_any_work(
    fleet: Fleet, model: str, field: str, kwargs: dict[str, object]
) -> None:
    assert fleet.tokenizer is not None
    path = "/v1/chat/completions" if "messages" in kwargs else "/v1/completions"
    before = _tokenize_calls(fleet.tokenizer)
    # Raw JSON, so values the SDK would not send (a number that overflows a float) arrive.
    body = json.dumps({"model": model, "max_tokens": 2, **kwargs}).encode()
    body = body.replace(json.dumps(INF).encode(), b"1e999")
    status, reply = _post_bytes(_port(fleet), path, body)
    error = _error(reply)
    assert status == 400 and error["param"] == field, error
    assert field.split("[")[0] in str(error["message"]), error
    assert _tokenize_calls(fleet.tokenizer) == before  # refused before tokenizing


def test_the_sdk_sees_unsupported_fields_refused_by_name(openai_client: OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(
            model=model, prompt="hi", max_tokens=2,
            extra_body={"tools": [{"type": "function", "function": {"name": "f"}}]},
        )
    assert info.value.param == "tools" and "`tools` is not supported" in info.value.message


def test_auto_tool_choice_needs_the_router_flags(openai_client: OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert info.value.param == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in info.value.message


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', "UTF-8"),
        ("/v1/completions", b'{not json', "not valid JSON"),
        ("/v1/completions", b'[1, 2]', "JSON object"),
        ("/v1/completions", b'', "empty"),
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "NaN"),
        ("/v1/completions", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b'}', "digits"),
        ("/v1/completions", b'{"prompt": "hi\\ud800", "max_tokens": 2}', "unpaired surrogate"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', "prompt must be"),
        ("/v1/chat/completions", b'{"max_tokens": 2}', "messages is required"),
        ("/v1/chat/completions", b'[' * 100_000 + b']' * 100_000, "nested too deeply"),
    ],
)
def test_malformed_bodies_get_openai_error_json(
    fleet: Fleet, path: str, body: bytes, needle: str
) -> None:
    status, reply = _post_bytes(_port(fleet), path, body)
    assert status == 400
    assert needle in str(_error(reply)["message"])


def test_unknown_routes_and_methods_get_openai_error_json(fleet: Fleet) -> None:
    status, reply, _ = _raw(_port(fleet), b"GET /v1/nothing HTTP/1.1\r\nHost: t\r\n\r\n")
    assert status == 404 and "/v1/nothing" in str(_error(reply)["message"])
    status, reply, _ = _raw(_port(fleet), b"GET /v1/completions HTTP/1.1\r\nHost: t\r\n\r\n")
    assert status == 405 and _error(reply)["code"] == 405


def test_slow_or_lying_bodies_get_408_at_the_deadline_while_others_are_served(
    fleet: Fleet, openai_client: OpenAI, model: str
) -> None:
    port = _port(fleet)
    # Content-Length larger than what is sent: the rest never comes.
    status, reply, elapsed = _raw(port, _head("/v1/completions", 1000), [b'{"prompt": "h'])
    assert status == 408 and _error(reply)["code"] == 408
    assert READ_DEADLINE_S <= elapsed < READ_DEADLINE_S + 5
    # A trickle: one byte every 0.2 s of a 100-byte body.
    status, reply, elapsed = _raw(port, _head("/v1/completions", 100), [b" "] * 100, 0.2)
    assert status == 408 and elapsed < READ_DEADLINE_S + 5
    # Meanwhile a held connection does not slow anyone else down.
    held = socket.create_connection(("127.0.0.1", port), timeout=10)
    with held:
        held.sendall(_head("/v1/completions", 1000) + b"{")
        started = time.monotonic()
        result = openai_client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert result.choices[0].finish_reason is not None
        assert time.monotonic() - started < READ_DEADLINE_S


def test_a_declared_oversize_body_is_413_before_it_is_sent(fleet: Fleet) -> None:
    size = LIMITS.max_body_bytes + 1
    head = _head("/v1/completions", size, "Expect: 100-continue\r\n")
    status, reply, elapsed = _raw(_port(fleet), head)
    assert status == 413 and str(size) in str(_error(reply)["message"])
    assert elapsed < READ_DEADLINE_S  # not read, not waited for


def test_prompts_longer_than_the_served_max_model_len_are_refused_naming_the_field(
    openai_client: OpenAI, model: str
) -> None:
    long_prompt = "The lighthouse keeper counted the ships " * 60  # > 256 tokens
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=model, prompt=long_prompt, max_tokens=2)
    assert info.value.param == "prompt" and f"is {MAX_MODEL_LEN} tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": long_prompt}])
    assert info.value.param == "messages" and "max_model_len" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=model, prompt="hi", max_tokens=MAX_MODEL_LEN)
    assert info.value.param == "max_tokens" and "in the completion" in info.value.message


def test_chat_without_max_tokens_stops_at_the_served_max_model_len(
    openai_client: OpenAI, model: str
) -> None:
    result = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Go on."}], temperature=0,
        extra_body={"ignore_eos": True},
    )
    usage = result.usage
    assert result.choices[0].finish_reason == "length" and usage is not None
    assert usage.prompt_tokens + usage.completion_tokens == MAX_MODEL_LEN  # not the model's 512


def test_grpc_requests_get_the_same_limits(fleet: Fleet) -> None:
    with grpc.insecure_channel(fleet.router_address) as channel:
        router = RouterClient(channel)
        too_long = build_request(prompt="a" * (LIMITS.max_input_chars + 1),
                                 params=common_pb2.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as info:
            router.generate(too_long, KEY)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt is" in info.value.details()
        stops = build_request(prompt="hi", params=common_pb2.SamplingParams(
            max_tokens=2, stop=[str(i) for i in range(LIMITS.max_stop_sequences + 1)]))
        with pytest.raises(grpc.RpcError) as info:
            router.generate(stops, KEY)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "stop has" in info.value.details()
