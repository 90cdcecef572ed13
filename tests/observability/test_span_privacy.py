"""Spans carry no secrets and no prompt text (docs/security.md, issue 38 finding 5), unit level.

The OTel SDK's in-memory exporter is the global provider for this module; a router HTTP app
(with an API-key policy and a router secret) runs in-process in front of an in-process
tokenizer service (tiny model, its TracingInterceptor on) and no engine. A chat and a
completion carrying a canary prompt and an API key go through parse, tokenize and route (503:
no engine), recording real spans; no span attribute, event attribute or span name may contain
the key, the router secret or the prompt; with the router's `--trace-prompts` opt-in the prompt
(only) is on the request's span as `gen_ai.prompt`. The end-to-end check, against a real
OTLP receiver, is tests/observability/test_trace_privacy.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from kvfleet.runtime import tracing
from router.engines.pool import EnginePool
from router.http.app import OpenAIApi
from router.http.uvicorn_server import HttpServer
from router.metrics import RouterMetrics
from router.pipeline import GenerationPipeline
from router.routing.decision import EngineSelector, RoutingConfig
from router.tenancy.policy_reload import PolicyStore
from router.tenancy.tenant_policy import load_policy
from router.tokenizer_client import TokenizerClient
from tests.fixtures.servers import ThreadedServer
from tokenizer_svc.server import build_server

API_KEY = "sk-canary-key-7f3a9"
ROUTER_SECRET = "router-secret-canary-5c1e"
PROMPT = "canary prompt text: the launch code is 0000"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The SDK with an in-memory exporter as the global provider, for this module only."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)  # noqa: SLF001
    trace._TRACER_PROVIDER_SET_ONCE = Once()  # noqa: SLF001 - the API sets it once per process
    trace.set_tracer_provider(provider)
    active = tracing._state["active"]  # noqa: SLF001 - what init_tracing sets
    tracing._state["active"] = True  # noqa: SLF001
    yield memory
    tracing._state["active"] = active  # noqa: SLF001
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved  # noqa: SLF001
    provider.shutdown()


@pytest.fixture(scope="module")
def base_url(exporter: InMemorySpanExporter, tiny_model_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serve(tiny_model_dir, tmp_path_factory, trace_prompts=False)


@pytest.fixture(scope="module")
def opted_in_url(exporter: InMemorySpanExporter, tiny_model_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serve(tiny_model_dir, tmp_path_factory, trace_prompts=True)


def serve(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
          trace_prompts: bool) -> Iterator[str]:
    """A router HTTP app (API keys, a router secret, no engine) before a tokenizer service."""
    policy = tmp_path_factory.mktemp("policy") / "policy.json"
    policy.write_text(json.dumps({"tenants": {"acme": [API_KEY]}}))
    tokenizer_server = ThreadedServer(
        lambda: build_server(tiny_model_dir, "127.0.0.1", 0)).start()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        metrics = RouterMetrics()
        pool = EnginePool(metrics=metrics, router_secret=ROUTER_SECRET)
        tokenizer = TokenizerClient(tokenizer_server.address)
        pipeline = GenerationPipeline(tokenizer, EngineSelector(RoutingConfig(), None, pool),
                                      pool, metrics, trace_prompts=trace_prompts)
        app = OpenAIApi(pipeline, PolicyStore(load_policy(policy)), metrics).app()
        server = HttpServer(app, "127.0.0.1", 0, 2.0)
        state["port"] = await server.start()
        state["stop"], state["loop"] = asyncio.Event(), asyncio.get_running_loop()
        ready.set()
        await state["stop"].wait()
        await server.stop()
        await tokenizer.close()
        await pool.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    try:
        assert ready.wait(30)
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(30)
        tokenizer_server.stop()


def post(url: str, body: dict[str, Any]) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}",
        "x-api-key": API_KEY})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as e:
        return e.code


def strings_of(span: ReadableSpan) -> list[str]:
    """Every string a span exports: its name, attribute values, events and their attributes."""
    values: list[Any] = [span.name, *(span.attributes or {}).values()]
    for event in span.events:
        values += [event.name, *(event.attributes or {}).values()]
    out: list[str] = []
    for value in values:
        out += [str(v) for v in value] if isinstance(value, tuple | list) else [str(value)]
    return out


def test_spans_hold_no_api_key_router_secret_or_prompt(
    base_url: str, exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    assert post(f"{base_url}/v1/chat/completions",
                {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}) == 503
    assert post(f"{base_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2}) == 503
    spans = exporter.get_finished_spans()
    names = {span.name for span in spans}
    # Not vacuous: the request, its tokenization (both sides) and routing were traced.
    assert {"POST /v1/chat/completions", "POST /v1/completions", "tokenize", "route",
            "kvfleet.v1.Tokenizer/Tokenize"} <= names, names
    assert {span.attributes.get("kvfleet.tenant") for span in spans
            if span.name.startswith("POST ")} == {"acme"}
    for span in spans:
        for text in strings_of(span):
            for secret in (API_KEY, ROUTER_SECRET, PROMPT, "launch code"):
                assert secret not in text, (span.name, text)


def test_the_operator_may_opt_in_to_prompt_text(
    opted_in_url: str, exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    assert post(f"{opted_in_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2}) == 503
    spans = exporter.get_finished_spans()
    (request,) = [span for span in spans if span.name == "POST /v1/completions"]
    assert request.attributes["gen_ai.prompt"] == PROMPT
    for span in spans:
        for text in strings_of(span):
            assert API_KEY not in text and ROUTER_SECRET not in text
