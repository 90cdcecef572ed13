"""The tokenizer service is off the token path: real processes (Redis, tokenizer, one engine,
router) over real sockets, the tiny model.

- Streaming costs one tokenizer call per request (Tokenize), none per token: the
  tokenizer's own Prometheus counter, over gRPC and over the OpenAI HTTP API with logprobs.
- The tokenizer killed (SIGKILL) and restarted on its port while a stream is in flight: the
  stream completes with the text of an uninterrupted run. The client reads through a small
  HTTP/2 window, so the router is provably still relaying when the tokenizer dies. While it
  is down a new request fails with UNAVAILABLE naming the tokenizer; once it is back, the
  next request succeeds.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.fleet import Fleet
from kvfleet.router_client import build_request
from kvfleet.v1 import router_pb2_grpc
from tests.fixtures.engine_harness import SMALL_WINDOW
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import CALL_TIMEOUT_S, RouterClient, greedy

pytestmark = pytest.mark.timeout(240)

PROMPT = "Once upon a time there was a small village by the sea"
# Long enough that its messages far exceed the client's small window.
LONG_STREAM_TOKENS = 400


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 1, "engine_args": ("--num-kv-blocks", "256"), "engine_threads": 1,
        "metrics": True,
    }


def tokenizer_calls(fleet: Fleet) -> Counter[str]:
    """RPCs the tokenizer has served, by method (its kvfleet:tokenizer_requests counter)."""
    assert fleet.tokenizer is not None
    url = f"http://127.0.0.1:{fleet.tokenizer.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    calls: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvfleet:tokenizer_requests_total":
                calls[sample.labels["method"]] += int(sample.value)
    return calls


def http_stream_with_logprobs(fleet: Fleet, max_tokens: int) -> list[dict]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 3}
    request = urllib.request.Request(
        f"{fleet.http_url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
        lines = [line.decode().strip() for line in response]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_streamed_tokens_cost_no_tokenizer_call(fleet: Fleet, client: RouterClient) -> None:
    before = tokenizer_calls(fleet)
    request = build_request(PROMPT, params=greedy(max_tokens=64, ignore_eos=True, logprobs=3))
    completion = client.generate(request)
    assert completion.num_tokens == 64 and completion.text
    chunks = http_stream_with_logprobs(fleet, 64)
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 64 and any(tokens)
    assert tokenizer_calls(fleet) - before == Counter({"Tokenize": 2})


def test_a_tokenizer_restart_mid_stream_breaks_nothing(fleet: Fleet, client: RouterClient) -> None:
    params = greedy(max_tokens=LONG_STREAM_TOKENS, ignore_eos=True, logprobs=5)
    request = build_request(PROMPT, params=params)
    reference = client.generate(request)
    assert reference.num_tokens == LONG_STREAM_TOKENS
    tokenizer = fleet.tokenizer
    assert tokenizer is not None
    with grpc.insecure_channel(fleet.router_address, options=SMALL_WINDOW) as channel:
        stream = router_pb2_grpc.RouterStub(channel).Generate(request, timeout=CALL_TIMEOUT_S)
        first = next(stream)  # tokenized and streaming; the window holds the rest back
        tokenizer.kill()
        tokenizer.wait(10)
        with pytest.raises(grpc.RpcError) as down:
            client.generate(request)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "tokenizer" in (down.value.details() or "")
        fleet.restart_tokenizer()
        rest = list(stream)
    assert first.text_delta + "".join(r.text_delta for r in rest) == reference.text
    assert sum(len(r.token_ids) for r in (first, *rest)) == LONG_STREAM_TOKENS
    assert rest[-1].finish_reason == "length"
    # The next request needs Tokenize: it reaches the restarted tokenizer.
    assert client.generate(request).text == reference.text
