"""The HTTP API of a router that has no engine: real uvicorn on loopback, answered with 503."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from router.engines.pool import EnginePool
from router.http.app import OpenAIApi
from router.http.uvicorn_server import HttpServer
from router.metrics import RouterMetrics
from router.pipeline import GenerationPipeline
from router.routing.decision import EngineSelector, RoutingConfig
from router.tenancy.policy_reload import PolicyStore
from router.tokenizer_client import TokenizerClient


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    ready = threading.Event()
    state: dict[str, object] = {}

    async def main() -> None:
        metrics = RouterMetrics()
        pool = EnginePool()
        # Token-id prompts never reach the tokenizer; nothing listens at this address.
        tokenizer = TokenizerClient("127.0.0.1:9")
        pipeline = GenerationPipeline(tokenizer, EngineSelector(RoutingConfig(), None, pool),
                                      pool, metrics)
        server = HttpServer(OpenAIApi(pipeline, PolicyStore.open(), metrics).app(),
                            "127.0.0.1", 0, 2.0)
        state["port"] = await server.start()
        stop = asyncio.Event()
        state["stop"], state["loop"] = stop, asyncio.get_running_loop()
        ready.set()
        await stop.wait()
        await server.stop()
        await tokenizer.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield f"http://127.0.0.1:{state['port']}"
    loop = state["loop"]
    assert isinstance(loop, asyncio.AbstractEventLoop)
    loop.call_soon_threadsafe(state["stop"].set)  # type: ignore[attr-defined]
    thread.join(30)


def post(url: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_no_engine_is_503_in_openai_error_json(base_url: str) -> None:
    status, body = post(f"{base_url}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
    assert status == 503
    error = body["error"]
    assert isinstance(error, dict)
    assert "no live engine" in str(error["message"]) and error["code"] == 503


def test_validation_comes_before_routing(base_url: str) -> None:
    status, body = post(f"{base_url}/v1/completions", {"prompt": [5], "temperature": -1})
    assert status == 400 and "temperature" in str(body["error"])


def test_health_and_empty_model_list(base_url: str) -> None:
    with urllib.request.urlopen(f"{base_url}/health", timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as reply:
        assert json.loads(reply.read()) == {"object": "list", "data": []}
