"""LoRA through the engine service: real gRPC and a real Redis server.

An in-process engine server (tests/fixtures/engine_harness.py) with `--lora-modules`-style
start-up adapters: Generate with `lora_id` gives the same tokens as the offline API with the
same adapter; LoadLoRAAdapter / UnloadLoRAAdapter change what GetLoad and the Redis registry
hash (`lora_adapters`) report; unloading lets a stream in flight finish; unknown adapters,
bad adapters and unloading an unknown name are INVALID_ARGUMENT naming the problem.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import grpc
import pytest
import redis

from engine import LLM, LoRARequest, SamplingParams
from kvfleet.contracts import redis_schema
from kvfleet.v1 import engine_pb2, engine_pb2_grpc
from tests.fixtures.engine_harness import (
    TIMEOUT_S,
    EngineHarness,
    engine_options,
    gen_request,
    make_prompt,
    run,
    tokens_of,
    wait_until,
)

PROMPT = make_prompt(3, 40)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir, tiny_lora_dirs, redis_server) -> Iterator[EngineHarness]:
    options = engine_options(
        tiny_model_dir, redis_server.url, "lora-1", enable_lora=True, max_loras=2,
        max_cpu_loras=3,
    )  # fmt: skip
    options = dataclasses.replace(
        options, lora_modules=(LoRARequest("all-r8", 1, str(tiny_lora_dirs["all-r8"])),)
    )
    harness = EngineHarness(options).start()
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def redis_client(redis_server) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture(scope="module")
def stub(lora_engine) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(lora_engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


@pytest.fixture(scope="module")
def offline(tiny_model_dir, tiny_lora_dirs) -> dict[str | None, list[int]]:
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    result: dict[str | None, list[int]] = {}
    for index, name in enumerate([None, "all-r8", "qv-r4"]):
        lora = None if name is None else LoRARequest(name, index, str(tiny_lora_dirs[name]))
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False, lora_request=lora)
        result[name] = out[0].outputs[0].token_ids
    return result


def adapters_in_redis(redis_client, engine_id: str) -> list[str]:
    raw = redis_client.hget(redis_schema.engine_key(engine_id), "lora_adapters")
    return [] if raw is None else json.loads(raw)


def generate(stub, request_id: str, lora: str = "") -> list[int]:
    request = gen_request(request_id, PROMPT, NEW_TOKENS)
    request.lora_id = lora
    return tokens_of(run(stub, request))


def test_lora_id_selects_the_adapter(stub, offline):
    assert generate(stub, "base") == offline[None]
    assert generate(stub, "lora", "all-r8") == offline["all-r8"]
    assert offline["all-r8"] != offline[None]


def test_load_and_unload_publish_to_get_load_and_redis(stub, offline, tiny_lora_dirs, redis_client):
    load = engine_pb2.LoadLoRAAdapterRequest(
        lora_name="qv-r4", lora_path=str(tiny_lora_dirs["qv-r4"])
    )
    assert list(stub.LoadLoRAAdapter(load, timeout=TIMEOUT_S).lora_adapters) == ["all-r8", "qv-r4"]
    info = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)
    assert list(info.lora_adapters) == ["all-r8", "qv-r4"]
    wait_until(lambda: adapters_in_redis(redis_client, "lora-1") == ["all-r8", "qv-r4"])
    assert generate(stub, "loaded", "qv-r4") == offline["qv-r4"]

    # Unload while a stream of that adapter is in flight: it finishes with the right tokens.
    request = gen_request("flying", PROMPT, NEW_TOKENS)
    request.lora_id = "qv-r4"
    stream = stub.Generate(request, timeout=TIMEOUT_S)
    first = next(stream)
    unload = engine_pb2.UnloadLoRAAdapterRequest(lora_name="qv-r4")
    assert list(stub.UnloadLoRAAdapter(unload, timeout=TIMEOUT_S).lora_adapters) == ["all-r8"]
    assert tokens_of([first, *stream]) == offline["qv-r4"]
    wait_until(lambda: adapters_in_redis(redis_client, "lora-1") == ["all-r8"])
    with pytest.raises(grpc.RpcError) as info_err:
        generate(stub, "late", "qv-r4")
    assert info_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'qv-r4' is not loaded" in info_err.value.details()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("unknown", "'nope' is not loaded"),
        ("unload-unknown", "'nope' is not loaded"),
        ("bad-path", "is not a directory"),
        ("missing-path", "lora_name and lora_path are required"),
    ],
)
def test_bad_lora_calls_are_invalid_argument(stub, call, message, tmp_path):
    with pytest.raises(grpc.RpcError) as info:
        if call == "unknown":
            generate(stub, "unknown", "nope")
        elif call == "unload-unknown":
            stub.UnloadLoRAAdapter(engine_pb2.UnloadLoRAAdapterRequest(lora_name="nope"))
        elif call == "bad-path":
            request = engine_pb2.LoadLoRAAdapterRequest(
                lora_name="x", lora_path=str(tmp_path / "no")
            )
            stub.LoadLoRAAdapter(request, timeout=TIMEOUT_S)
        else:
            stub.LoadLoRAAdapter(engine_pb2.LoadLoRAAdapterRequest(lora_name="x"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_lora_flags_follow_vllm(tiny_model_dir):
    from engine.service.server import build_parser, options_from_args

    base = ["--model", str(tiny_model_dir), "--redis-url", "redis://127.0.0.1:1/0",
            "--engine-id", "e1"]  # fmt: skip
    args = build_parser().parse_args(
        [*base, "--enable-lora", "--max-loras", "4", "--max-lora-rank", "8",
         "--max-cpu-loras", "6", "--lora-modules", "a=/tmp/a", "b=/tmp/b"]
    )  # fmt: skip
    options = options_from_args(args)
    engine = options.engine
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 4, 8)
    assert engine.max_cpu_loras == 6
    assert [(m.lora_name, m.lora_path) for m in options.lora_modules] == [
        ("a", "/tmp/a"), ("b", "/tmp/b")
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        options_from_args(build_parser().parse_args([*base, "--lora-modules", "a=/tmp/a"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--lora-modules", "no-equals-sign"])
