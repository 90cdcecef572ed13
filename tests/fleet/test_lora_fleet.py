"""LoRA across a real fleet: Redis, tokenizer, two engines and the router as processes.

Engines start with `--enable-lora --lora-modules all-r8=DIR`. Checked: `/v1/models` lists the
adapter with its base model as `parent`; the `model` field selects the adapter and the tokens
equal the offline engine's with the same adapter; `POST /v1/load_lora_adapter` fans out to
both engines, and with the adapter then held by one engine only, every request for it goes
there; `POST /v1/unload_lora_adapter` removes it from `/v1/models`; bad calls are 400 naming
the problem; a tenant whose policy does not list the adapter is refused (404 naming it, as for
any model the tenant may not use) while one that lists it is served. The fleet runs with
`--allow-runtime-lora-updating` and `--lora-allowed-dirs` (the adapters' directory): only the
admin tenant's key may load or unload (others get 403), and a path outside the directory,
missing, or a symlink out of it all get one identical 400.

Last, on a second fleet (`fleet_options` parametrized with `--max-num-seqs 1`): with the
adapter held by one engine only and that engine's one sequence slot taken by a long request,
the router loads the adapter on the other engine and serves the next request there.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, LoRARequest, SamplingParams
from kvfleet.contracts import redis_schema
from kvfleet.contracts.adapter_paths import REFUSED_MESSAGE
from kvfleet.fleet import Fleet
from kvfleet.router_client import build_request
from kvfleet.runtime.service_auth import credential_metadata, read_secret
from kvfleet.v1 import engine_pb2, engine_pb2_grpc, router_pb2
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import API_KEYS, RouterClient, greedy, wait_until

pytestmark = pytest.mark.timeout(300)

KEY = API_KEYS["tenant-0"]
ADMIN_KEY = "key-admin"
# Tenants whose policy lists models: the adapter all-r8 only, or the base model only.
ADAPTER_KEY, BASE_KEY = "key-adapter-only", "key-base-only"
PROMPT = list(range(30, 70))  # 40 tokens: two cacheable blocks
NEW_TOKENS = 6
# The second fleet: one sequence per engine at most, so one long request saturates one.
ONE_SEQUENCE = ("--max-num-seqs", "1")


@pytest.fixture(scope="module")
def fleet_options(request, tiny_model_dir, tiny_lora_dirs) -> FleetOptions:
    """Two engines serving all-r8; `request.param` (indirect parametrization): more flags."""
    return {
        "num_engines": 2,
        "api_keys": policy(Path(tiny_model_dir).name),
        "engine_args": ("--num-kv-blocks", "128", "--enable-lora", "--max-loras", "2",
                        "--lora-modules", f"all-r8={tiny_lora_dirs['all-r8']}",
                        *getattr(request, "param", ())),
        "allow_runtime_lora_updating": True,
        "lora_allowed_dirs": (tiny_lora_dirs["all-r8"].parent,),
        "start_timeout_s": 180,
    }  # fmt: skip


def policy(base_model: str) -> dict[str, Any]:
    tenants: dict[str, Any] = {name: [key] for name, key in API_KEYS.items()}
    tenants["adapter-only"] = {"keys": [ADAPTER_KEY], "models": ["all-r8"]}
    tenants["base-only"] = {"keys": [BASE_KEY], "models": [base_model]}
    tenants["ops"] = {"keys": [ADMIN_KEY], "admin": True}
    return {"tenants": tenants}


@pytest.fixture(scope="module")
def offline(tiny_model_dir, tiny_lora_dirs) -> dict[str, list[int]]:
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    result = {}
    for index, name in enumerate(["all-r8", "qv-r4"], start=1):
        lora = LoRARequest(name, index, str(tiny_lora_dirs[name]))
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False, lora_request=lora)
        result[name] = out[0].outputs[0].token_ids
    return result


def http(fleet: Fleet, method: str, path: str, body: Any = None,
         key: str = KEY) -> tuple[int, str]:  # fmt: skip
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{fleet.http_url}{path}", data=data, method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def models(fleet: Fleet) -> dict[str, Any]:
    status, text = http(fleet, "GET", "/v1/models")
    assert status == 200
    return {m["id"]: m["parent"] for m in json.loads(text)["data"]}


def adapters_of(redis_client: redis.Redis) -> dict[str, list[str]]:
    result = {}
    for engine_id in sorted(m.decode() for m in redis_client.smembers(redis_schema.ENGINES_SET)):
        raw = redis_client.hget(redis_schema.engine_key(engine_id), "lora_adapters")
        result[engine_id] = [] if raw is None else json.loads(raw)
    return result


def unload_on_engine(fleet: Fleet, redis_client: redis.Redis, engine_id: str, name: str) -> None:
    """Unload an adapter on one engine only, directly, with the router credential."""
    address = redis_client.hget(redis_schema.engine_key(engine_id), "address").decode()
    metadata = credential_metadata(read_secret(fleet.router_secret_file))
    with grpc.insecure_channel(address) as channel:
        engine_pb2_grpc.EngineStub(channel).UnloadLoRAAdapter(
            engine_pb2.UnloadLoRAAdapterRequest(lora_name=name), metadata=metadata, timeout=30
        )
    wait_until(lambda: name not in adapters_of(redis_client)[engine_id])


def lora_request(model: str, max_tokens: int = NEW_TOKENS, prompt: list[int] = PROMPT,
                 n: int = 1) -> router_pb2.RouterGenerateRequest:  # fmt: skip
    params = greedy(max_tokens, ignore_eos=True, n=n)
    request = build_request(prompt_token_ids=prompt, params=params)
    request.model = model
    return request


def generate(client: RouterClient, model: str) -> tuple[list[int], str]:
    request = lora_request(model)
    ids: list[int] = []
    engine_id = ""
    for response in client.stream(request, KEY):
        ids.extend(response.token_ids)
        engine_id = response.engine_id or engine_id
    return ids, engine_id


def test_models_list_the_adapter_with_its_parent(fleet, tiny_model_dir, redis_client):
    wait_until(lambda: list(adapters_of(redis_client).values()) == [["all-r8"], ["all-r8"]])
    assert models(fleet) == {Path(tiny_model_dir).name: None, "all-r8": Path(tiny_model_dir).name}


def test_model_field_selects_the_adapter(client, offline, redis_client):
    wait_until(lambda: list(adapters_of(redis_client).values()) == [["all-r8"], ["all-r8"]])
    assert generate(client, "all-r8")[0] == offline["all-r8"]
    assert generate(client, "")[0] != offline["all-r8"]


def test_load_fans_out_and_routing_prefers_holders(fleet, client, offline, tiny_lora_dirs,
                                                    redis_client):  # fmt: skip
    body = {"lora_name": "qv-r4", "lora_path": str(tiny_lora_dirs["qv-r4"])}
    status, text = http(fleet, "POST", "/v1/load_lora_adapter", body, ADMIN_KEY)
    assert (status, text) == (200, "Success: LoRA adapter 'qv-r4' added successfully.")
    wait_until(lambda: all("qv-r4" in a for a in adapters_of(redis_client).values()))
    engines = list(adapters_of(redis_client))
    unload_on_engine(fleet, redis_client, engines[0], "qv-r4")  # left on engines[1] only
    assert adapters_of(redis_client)[engines[0]] == ["all-r8"]
    for _ in range(4):
        ids, engine_id = generate(client, "qv-r4")
        assert ids == offline["qv-r4"]
        assert engine_id == engines[1]
    status, text = http(fleet, "POST", "/v1/unload_lora_adapter", {"lora_name": "qv-r4"},
                        ADMIN_KEY)
    # engines[0] no longer serves it: the first refusal is answered, naming the adapter.
    assert status == 400 and "'qv-r4' is not loaded" in text
    wait_until(lambda: "qv-r4" not in models(fleet))


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"},
         REFUSED_MESSAGE),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path is required"),
        ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"},
         "'never-loaded' is not loaded"),
    ],
)  # fmt: skip
def test_bad_lora_calls_are_400(fleet, path, body, message):
    status, text = http(fleet, "POST", path, body, ADMIN_KEY)
    assert status == 400, text
    assert message in json.loads(text)["error"]["message"]


def test_only_admins_change_adapters(fleet, tiny_lora_dirs, redis_client):
    body = {"lora_name": "qv-r4", "lora_path": str(tiny_lora_dirs["qv-r4"])}
    for path, payload in (("/v1/load_lora_adapter", body),
                          ("/v1/unload_lora_adapter", {"lora_name": "all-r8"})):
        status, text = http(fleet, "POST", path, payload, KEY)
        assert status == 403, text
        assert json.loads(text)["error"]["type"] == "PermissionDeniedError"
        status, _ = http(fleet, "POST", path, payload, "no-such-key")
        assert status == 401
    assert all(a == ["all-r8"] for a in adapters_of(redis_client).values())


def test_adapter_paths_outside_the_roots_get_one_answer(fleet, tiny_lora_dirs, tmp_path):
    root = tiny_lora_dirs["all-r8"].parent
    escape = root / "escape"
    if not escape.exists():
        escape.symlink_to(tmp_path, target_is_directory=True)  # a symlink out of the root
    paths = ["/etc", str(root / ".." / "x"), str(root / "missing"), str(escape),
             "relative/dir", str(tiny_lora_dirs["qv-r4"] / "adapter_config.json")]
    answers = set()
    for path in paths:
        status, text = http(fleet, "POST", "/v1/load_lora_adapter",
                            {"lora_name": "x", "lora_path": path}, ADMIN_KEY)
        answers.add((status, json.loads(text)["error"]["message"]))
    assert answers == {(400, REFUSED_MESSAGE)}


def completion(fleet: Fleet, model: str, key: str) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    status, text = http(fleet, "POST", "/v1/completions", body, key)
    return status, json.loads(text)


def test_tenant_policy_limits_the_adapters(fleet, tiny_model_dir, redis_client):
    wait_until(lambda: all("all-r8" in a for a in adapters_of(redis_client).values()))
    status, reply = completion(fleet, "all-r8", ADAPTER_KEY)
    assert status == 200, reply
    assert (reply["model"], reply["usage"]["completion_tokens"]) == ("all-r8", NEW_TOKENS)
    # all-r8 is served, but not to a tenant whose policy lists the base model only.
    status, reply = completion(fleet, "all-r8", BASE_KEY)
    assert status == 404, reply
    assert reply["error"]["message"] == (
        "The model `all-r8` does not exist or tenant base-only may not use it"
    )
    assert completion(fleet, Path(tiny_model_dir).name, BASE_KEY)[0] == 200
    assert completion(fleet, Path(tiny_model_dir).name, ADAPTER_KEY)[0] == 404


def router_counter(fleet: Fleet, name: str, **labels: str) -> float:
    assert fleet.router is not None
    url = f"http://127.0.0.1:{fleet.router.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())  # fmt: skip


# Last in the module: the fixture's new parameter replaces the fleet of the tests above.
@pytest.mark.parametrize("fleet_options", [ONE_SEQUENCE], indirect=True)
def test_adapter_is_loaded_on_another_engine_when_its_holder_is_saturated(
    fleet, client, offline, redis_client
):
    wait_until(lambda: list(adapters_of(redis_client).values()) == [["all-r8"], ["all-r8"]])
    holder, other = adapters_of(redis_client)
    unload_on_engine(fleet, redis_client, other, "all-r8")
    loads = "kvfleet:router_lora_adapter_loads_total"
    assert router_counter(fleet, loads) == 0
    # A long request for the adapter takes the holder's only sequence slot: it runs once its
    # first tokens arrive, and its 4 samples of 500 tokens, one after the other, keep the
    # holder saturated far longer than the next request takes to be routed (a few seconds
    # against tens of milliseconds here).
    long_stream = client.stream(lora_request("all-r8", 500, prompt=PROMPT[:8], n=4), KEY)
    try:
        assert len(next(long_stream).token_ids) > 0
        ids, engine_id = generate(client, "all-r8")
        assert (engine_id, ids) == (other, offline["all-r8"])
        assert router_counter(fleet, loads, engine_id=other, outcome="loaded") == 1
    finally:
        long_stream.cancel()
    wait_until(lambda: adapters_of(redis_client)[other] == ["all-r8"])
