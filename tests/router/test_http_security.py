"""The router's HTTP front door against hostile callers, with no engine: real uvicorn on
loopback, one app per configuration (docs/security.md).

- Runtime LoRA updates: without `--allow-runtime-lora-updating` the routes are unknown (404,
  the same answer as any unknown path); with it, a non-admin key gets 403 before the body is
  read or any engine is asked (no engine exists here: reaching one would be a 503); an admin's
  path outside `--lora-allowed-dirs` is one identical 400.
- JSON bodies need a JSON Content-Type (415), booleans are JSON booleans, ranges are enforced,
  messages are checked per role: each a 400 naming the field.
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

from kvfleet.contracts.adapter_paths import REFUSED_MESSAGE, AdapterRoots
from router.engines.pool import EnginePool
from router.http.app import OpenAIApi
from router.http.lora_endpoints import RuntimeLoRAConfig
from router.http.uvicorn_server import HttpServer
from router.metrics import RouterMetrics
from router.pipeline import GenerationPipeline
from router.routing.decision import EngineSelector, RoutingConfig
from router.tenancy.policy_reload import PolicyStore
from router.tenancy.tenant_policy import load_policy
from router.tokenizer_client import TokenizerClient

ADMIN, USER, ADMIN_KEY_OF_USER_TENANT = "sk-ops", "sk-user", "sk-user-admin"
LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def serve(policy_path: Path, runtime_lora: RuntimeLoRAConfig) -> Iterator[str]:
    """A router HTTP app with no engine and no tokenizer, on a free port, in a thread."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        metrics = RouterMetrics()
        pool = EnginePool()
        tokenizer = TokenizerClient("127.0.0.1:9")  # nothing listens: never reached here
        pipeline = GenerationPipeline(tokenizer, EngineSelector(RoutingConfig(), None, pool),
                                      pool, metrics)
        policies = PolicyStore(load_policy(policy_path))
        api = OpenAIApi(pipeline, policies, metrics, runtime_lora=runtime_lora)
        server = HttpServer(api.app(), "127.0.0.1", 0, 2.0)
        state["port"] = await server.start()
        state["stop"], state["loop"] = asyncio.Event(), asyncio.get_running_loop()
        ready.set()
        await state["stop"].wait()
        await server.stop()
        await tokenizer.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield f"http://127.0.0.1:{state['port']}"
    state["loop"].call_soon_threadsafe(state["stop"].set)
    thread.join(30)


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("policy") / "policy.json"
    path.write_text(json.dumps({"tenants": {
        "ops": {"keys": [ADMIN], "admin": True},
        "users": {"keys": [USER, {"key": ADMIN_KEY_OF_USER_TENANT, "admin": True}]},
    }}))
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    (root / "a").mkdir()
    return root


@pytest.fixture(scope="module")
def default_url(policy_path: Path) -> Iterator[str]:
    yield from serve(policy_path, RuntimeLoRAConfig())


@pytest.fixture(scope="module")
def lora_url(policy_path: Path, adapters: Path) -> Iterator[str]:
    yield from serve(policy_path, RuntimeLoRAConfig(True, AdapterRoots.of([adapters])))


def post(url: str, body: Any, key: str = USER,
         content_type: str | None = "application/json") -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    request = urllib.request.Request(url, data=data, headers=headers)
    if content_type is None:  # urllib would add a form content type of its own
        request.remove_header("Content-type")
        request.unredirected_hdrs.pop("Content-type", None)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- finding 1: fleet changes are off by default, admin-only when on ------------------------


@pytest.mark.parametrize("route", LORA_ROUTES)
def test_lora_routes_are_unknown_unless_enabled(default_url: str, route: str) -> None:
    unknown = post(f"{default_url}/v1/no_such_route", {}, ADMIN)
    status, body = post(f"{default_url}{route}", {"lora_name": "a", "lora_path": "/x"}, ADMIN)
    assert (status, body["error"]["type"]) == (404, unknown[1]["error"]["type"]) == (
        404, "NotFoundError")
    assert body["error"]["message"] == f"no route for {route}"
    with urllib.request.urlopen(f"{default_url}/openapi.json", timeout=30) as reply:
        assert not set(LORA_ROUTES) & set(json.loads(reply.read())["paths"])


@pytest.mark.parametrize("route", LORA_ROUTES)
def test_non_admins_get_403_before_any_engine(lora_url: str, adapters: Path, route: str) -> None:
    body = {"lora_name": "a", "lora_path": str(adapters / "a")}
    status, reply = post(f"{lora_url}{route}", body, USER)
    assert status == 403, reply
    assert reply["error"] == {
        "message": "only admin API keys may load or unload LoRA adapters",
        "type": "PermissionDeniedError", "param": None, "code": 403}
    # Not even the body is looked at: a non-admin learns nothing about paths.
    assert post(f"{lora_url}{route}", {"lora_path": "/etc"}, USER)[0] == 403
    assert post(f"{lora_url}{route}", body, "sk-unknown")[0] == 401


@pytest.mark.parametrize("key", [ADMIN, ADMIN_KEY_OF_USER_TENANT])
def test_admins_reach_the_engines(lora_url: str, adapters: Path, key: str) -> None:
    status, reply = post(f"{lora_url}/v1/load_lora_adapter",
                         {"lora_name": "a", "lora_path": str(adapters / "a")}, key)
    assert status == 503 and "no live engine" in reply["error"]["message"]


def test_paths_outside_the_roots_are_one_answer(lora_url: str, adapters: Path,
                                                tmp_path: Path) -> None:
    (adapters / "out").symlink_to(tmp_path, target_is_directory=True)
    paths = ["/etc", f"{adapters}/../x", str(adapters / "out"), "a", str(tmp_path)]
    answers = {
        json.dumps(post(f"{lora_url}/v1/load_lora_adapter",
                        {"lora_name": "a", "lora_path": path}, ADMIN))
        for path in paths
    }
    assert answers == {json.dumps([400, {"error": {
        "message": REFUSED_MESSAGE, "type": "BadRequestError", "param": "lora_path",
        "code": 400}}])}


# -- finding 4: strict input ----------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/jsonx", "multipart/form-data"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_json_bodies_need_a_json_content_type(default_url: str, route: str,
                                              content_type: str | None) -> None:
    status, reply = post(f"{default_url}{route}", {"prompt": [5], "max_tokens": 1},
                         content_type=content_type)
    assert status == 415, reply
    assert "Content-Type: application/json" in reply["error"]["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_json_content_types_with_parameters_pass(default_url: str, content_type: str) -> None:
    status, reply = post(f"{default_url}/v1/completions", {"prompt": [5], "max_tokens": 1},
                         content_type=content_type)
    assert status == 503, reply  # past parsing: no engine


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [5], "stream": "yes"}, "stream"),
    ({"prompt": [5], "stream": 1}, "stream"),
    ({"prompt": [5], "echo": "true"}, "echo"),
    ({"prompt": [5], "ignore_eos": "no"}, "ignore_eos"),
    ({"prompt": [5], "logprobs": "yes"}, "logprobs"),
    ({"prompt": [5], "max_tokens": "5"}, "max_tokens"),
    ({"prompt": [5], "max_tokens": True}, "max_tokens"),
    ({"prompt": [5], "temperature": "0.5"}, "temperature"),
    ({"prompt": [5], "top_k": 0}, "top_k"),
    ({"prompt": [5], "top_k": -2}, "top_k"),
    ({"prompt": [5], "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
])
def test_completions_fields_are_strict(default_url: str, body: dict[str, Any],
                                       param: str) -> None:
    status, reply = post(f"{default_url}/v1/completions", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "tool"}]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
])
def test_chat_fields_are_strict(default_url: str, body: dict[str, Any], param: str) -> None:
    status, reply = post(f"{default_url}/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param


@pytest.mark.parametrize("top_k", [-1, 1, 40])
def test_documented_top_k_values_pass(default_url: str, top_k: int) -> None:
    status, reply = post(f"{default_url}/v1/completions", {"prompt": [5], "top_k": top_k})
    assert status == 503, reply
