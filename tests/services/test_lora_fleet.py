"""LoRA across a real fleet: Redis, tokenizer, two engines and the router as processes.

Engines start with `--enable-lora --lora-modules all-r8=DIR`. Checked: `/v1/models` lists the
adapter with its base model as `parent`; the `model` field selects the adapter and the tokens
equal the offline engine's with the same adapter; `POST /v1/load_lora_adapter` fans out to
both engines, and with the adapter then held by one engine only, every request for it goes
there; `POST /v1/unload_lora_adapter` removes it from `/v1/models`; bad calls are 400 naming
the problem.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from engine import LLM, LoRARequest, SamplingParams
from kvfleet import redis_schema
from kvfleet.fleet import Fleet, FleetConfig
from kvfleet.service_auth import credential_metadata, read_secret
from kvfleet.v1 import engine_pb2, engine_pb2_grpc
from router.client import build_request
from tests.services.router_fleet import API_KEYS, RouterClient, greedy, wait_until, write_api_keys

pytestmark = pytest.mark.timeout(300)

KEY = API_KEYS["tenant-0"]
PROMPT = list(range(30, 70))  # 40 tokens: two cacheable blocks
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tiny_lora_dirs, tmp_path_factory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("lora-fleet")
    config = FleetConfig(
        model_dir=tiny_model_dir,
        num_engines=2,
        api_keys=write_api_keys(work / "keys.json"),
        engine_args=("--num-kv-blocks", "128", "--enable-lora", "--max-loras", "2",
                     "--lora-modules", f"all-r8={tiny_lora_dirs['all-r8']}"),
        log_dir=work / "logs",
        start_timeout_s=180,
    )  # fmt: skip
    with Fleet(config) as started:
        yield started


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> Iterator[RouterClient]:
    with grpc.insecure_channel(fleet.router_address) as channel:
        yield RouterClient(channel)


@pytest.fixture(scope="module")
def redis_client(fleet: Fleet) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(fleet.redis_url)
    yield client
    client.close()


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


def http(fleet: Fleet, method: str, path: str, body: Any = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{fleet.http_url}{path}", data=data, method=method,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
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


def generate(client: RouterClient, model: str) -> tuple[list[int], str]:
    request = build_request(prompt_token_ids=PROMPT, params=greedy(NEW_TOKENS, ignore_eos=True))
    request.model = model
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
    status, text = http(fleet, "POST", "/v1/load_lora_adapter", body)
    assert (status, text) == (200, "Success: LoRA adapter 'qv-r4' added successfully.")
    wait_until(lambda: all("qv-r4" in a for a in adapters_of(redis_client).values()))
    # Leave it on one engine only (unloaded on the other directly, with the router credential).
    engines = list(adapters_of(redis_client))
    address = redis_client.hget(redis_schema.engine_key(engines[0]), "address").decode()
    metadata = credential_metadata(read_secret(fleet.router_secret_file))
    with grpc.insecure_channel(address) as channel:
        engine_pb2_grpc.EngineStub(channel).UnloadLoRAAdapter(
            engine_pb2.UnloadLoRAAdapterRequest(lora_name="qv-r4"), metadata=metadata, timeout=30
        )
    wait_until(lambda: adapters_of(redis_client)[engines[0]] == ["all-r8"])
    for _ in range(4):
        ids, engine_id = generate(client, "qv-r4")
        assert ids == offline["qv-r4"]
        assert engine_id == engines[1]
    status, text = http(fleet, "POST", "/v1/unload_lora_adapter", {"lora_name": "qv-r4"})
    # engines[0] no longer serves it: the first refusal is answered, naming the adapter.
    assert status == 400 and "'qv-r4' is not loaded" in text
    wait_until(lambda: "qv-r4" not in models(fleet))


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"},
         "is not a directory"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path is required"),
        ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"},
         "'never-loaded' is not loaded"),
    ],
)  # fmt: skip
def test_bad_lora_calls_are_400(fleet, path, body, message):
    status, text = http(fleet, "POST", path, body)
    assert status == 400, text
    assert message in json.loads(text)["error"]["message"]
