"""The engine service end to end: real gRPC over loopback, real Redis, the tiny model.

Covers: streamed tokens equal the offline greedy output; prefix-cache hits are reported;
the Redis registry hash and block set follow kvfleet.contracts.redis_schema exactly (members are the
prompt's block hashes, evictions shrink the set, a restart takes a new epoch and drops the
old set); cancelling a stream frees its blocks; bad requests get INVALID_ARGUMENT naming
the field without disturbing a request in flight; Redis outages never stop serving and the
engine re-registers with its full cache when Redis returns; SIGTERM drains a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.llm import LLM
from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.redis_server import RedisServer
from kvfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.fixtures.engine_harness import (
    SMALL_WINDOW,
    EngineHarness,
    blocks_of,
    engine_options,
    gen_request,
    generated_tokens,
    make_prompt,
    run,
    tokens_of,
    wait_all_blocks_free,
    wait_until,
)

TIMEOUT_S = 30
BLOCK_SIZE = 16
REPO_ROOT = Path(__file__).resolve().parents[2]


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)


@pytest.fixture
def start_engine(tiny_model_dir: Path) -> Iterator:
    """Factory: an in-process engine server; all are stopped (deregistering) at teardown."""
    started: list[EngineHarness] = []

    def start(redis_url: str, engine_id: str, **engine_kwargs: object) -> EngineHarness:
        options = engine_options(tiny_model_dir, redis_url, engine_id, **engine_kwargs)
        harness = EngineHarness(options).start()
        started.append(harness)
        return harness

    yield start
    for harness in started:
        harness.stop()


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir: Path, redis_server: RedisServer) -> Iterator[EngineHarness]:
    harness = EngineHarness(engine_options(tiny_model_dir, redis_server.url, "shared")).start()
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def stub(shared_engine: EngineHarness) -> Iterator[engine_pb2_grpc.EngineStub]:
    with grpc.insecure_channel(shared_engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def greedy(offline: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


# -- generation ------------------------------------------------------------------------------


def test_stream_matches_offline_greedy_and_reports_cache_hits(stub, offline, shared_engine):
    prompt = make_prompt(1, 40)
    expected = greedy(offline, prompt, 12)

    first = run(stub, gen_request("greedy-1", prompt, 12))
    assert tokens_of(first) == expected
    assert len(first) == 12  # one message per step
    assert all(not r.HasField("finish_reason") for r in first[:-1])
    assert {r.engine_id for r in first} == {"shared"}
    last = first[-1]
    assert last.finish_reason == "length"
    assert not last.stop_reason.HasField("reason")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 12)
    assert last.usage.total_tokens == 52
    assert last.num_cached_tokens == 0

    second = run(stub, gen_request("greedy-2", prompt, 12))
    assert tokens_of(second) == expected
    assert second[-1].num_cached_tokens == 32  # two full blocks; the last token is recomputed

    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)
    assert (load.engine_id, load.block_size, load.max_model_len) == ("shared", 16, 256)
    assert load.epoch == shared_engine.server.epoch
    assert load.kv_blocks_total == 64


def test_stop_token_sets_stop_reason(stub, offline):
    prompt = make_prompt(2, 20)
    expected = greedy(offline, prompt, 6)
    responses = run(stub, gen_request("stop-1", prompt, 6, stop_token_ids=[expected[3]]))
    assert tokens_of(responses) == expected[: expected.index(expected[3]) + 1]
    assert responses[-1].finish_reason == "stop"
    assert responses[-1].stop_reason.token_id == expected[3]


def test_cancelled_stream_is_aborted_and_frees_its_blocks(stub, shared_engine):
    before = generated_tokens(shared_engine)
    call = stub.Generate(gen_request("cancel-1", make_prompt(3, 30), 200), timeout=TIMEOUT_S)
    for _ in range(3):
        next(call)
    call.cancel()
    load = wait_all_blocks_free(stub)
    assert load.kv_cache_usage == 0.0
    assert generated_tokens(shared_engine) - before < 200  # aborted, not run to the end
    shared_engine.in_engine_thread(shared_engine.server.async_engine.engine.kv.check_integrity)


def test_async_consumer_leaving_early_aborts_the_request(stub, shared_engine):
    engine = shared_engine.server.async_engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def break_early() -> int:
        outputs = engine.generate("leave-1", make_prompt(4, 30), params)
        async with contextlib.aclosing(outputs) as stream:
            async for output in stream:
                return len(output.token_ids)
        return 0

    async def cancel_task() -> None:
        async def consume() -> None:
            async for _ in engine.generate("leave-2", make_prompt(5, 30), params):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    before = generated_tokens(shared_engine)
    assert shared_engine.call(break_early) == 1
    wait_all_blocks_free(stub)
    shared_engine.call(cancel_task)
    wait_all_blocks_free(stub)
    assert generated_tokens(shared_engine) - before < 400
    assert not engine.engine.has_unfinished_requests()


def thread_cpu_ticks(native_id: int) -> int:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_idle_engine_thread_sleeps(stub, shared_engine):
    wait_all_blocks_free(stub)
    loops = [t.native_id for t in threading.enumerate() if t.name == "engine-loop"]
    assert loops and all(loops)
    before = sum(thread_cpu_ticks(tid) for tid in loops if tid is not None)
    time.sleep(0.5)
    after = sum(thread_cpu_ticks(tid) for tid in loops if tid is not None)
    assert after - before <= 2  # a busy loop would burn ~50 ticks (100 Hz) in 0.5 s


def test_abort_rpc_ends_the_stream_with_abort(stub):
    call = stub.Generate(gen_request("abort-1", make_prompt(6, 30), 200), timeout=TIMEOUT_S)
    next(call)
    assert stub.Abort(engine_pb2.AbortRequest(request_id="abort-1"), timeout=TIMEOUT_S).found
    last = list(call)[-1]
    assert last.finish_reason == "abort"
    assert last.usage.prompt_tokens == 30
    assert not stub.Abort(engine_pb2.AbortRequest(request_id="abort-1"), timeout=TIMEOUT_S).found
    wait_all_blocks_free(stub)


BAD_REQUESTS: list[tuple[dict[str, object], str]] = [
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[5, 10**6]), "outside the vocabulary"),
    (dict(temperature=-1.0), "temperature"),
    (dict(max_tokens=300), "max_model_len"),
    (dict(top_k=0), "top_k"),
    (dict(n=2), "the router fans n > 1 out"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=2, top_logprobs=3), "disagree"),
    (dict(request_id=""), "request_id"),
    (dict(request_id="good-1"), "already in use"),
    (dict(structured_outputs=common_pb2.StructuredOutputs(regex="(")),
     "structured_outputs.regex"),
]


def test_bad_requests_are_refused_without_disturbing_one_in_flight(stub, offline, shared_engine):
    good_prompt = make_prompt(7, 30)
    expected = greedy(offline, good_prompt, 200)
    # The engine thread stops at the end of the first step that has the good request running
    # (a one-shot step listener: the step's outputs and load snapshot are out by then) and
    # waits while the bad requests come in, so the good one is still in flight however slow
    # or fast the machine is. Validation runs on the event loop, not the engine thread.
    async_engine = shared_engine.server.async_engine
    paused, resume = threading.Event(), threading.Event()

    def pause_once_running(_events: object) -> None:
        if not paused.is_set() and async_engine.load.num_running == 1:
            paused.set()
            resume.wait(TIMEOUT_S)

    async_engine.add_step_listener(pause_once_running)
    good = stub.Generate(gen_request("good-1", good_prompt, 200), timeout=TIMEOUT_S)
    try:
        assert paused.wait(TIMEOUT_S)
        received = list(next(good).token_ids)
        refuse_all_bad_requests(stub)
    finally:
        resume.set()
    received += tokens_of(list(good))
    assert received == expected


def refuse_all_bad_requests(stub) -> None:
    for index, (overrides, message) in enumerate(BAD_REQUESTS):
        fields = dict(overrides)
        request = gen_request(
            str(fields.pop("request_id", "bad")),
            list(fields.pop("prompt", [5, 6, 7])),  # type: ignore[call-overload]
            int(fields.pop("max_tokens", 4)),  # type: ignore[call-overload]
            **fields,
        )
        with pytest.raises(grpc.RpcError) as info:
            run(stub, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, overrides
        assert message in info.value.details(), (overrides, info.value.details())
        if index == 0:  # the refusals really ran next to the good request
            assert stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S).num_running == 1
    lora = gen_request("bad-lora", [5, 6, 7], 4)
    lora.lora_id = "adapter"
    with pytest.raises(grpc.RpcError, match="LoRA adapters are not enabled"):
        run(stub, lora)


# -- Redis -----------------------------------------------------------------------------------


def test_registry_hash_and_block_set_follow_the_schema(
    tiny_model_dir, start_engine, redis_server, redis_client
):
    engine = start_engine(redis_server.url, "schema-1")
    prompt = make_prompt(8, 48)
    with grpc.insecure_channel(engine.address) as channel:
        responses = run(engine_pb2_grpc.EngineStub(channel),
                        gen_request("schema", prompt, 1, cache_salt="tenant-a"))
    assert len(tokens_of(responses)) == 1
    epoch = engine.server.epoch
    expected = set(hash_token_blocks(prompt, BLOCK_SIZE, cache_salt="tenant-a"))
    assert len(expected) == 3
    wait_until(lambda: blocks_of(redis_client, "schema-1", epoch) == expected)

    key = redis_schema.engine_key("schema-1")
    fields = {k.decode(): v.decode() for k, v in redis_client.hgetall(key).items()}
    assert fields["address"] == engine.address
    assert fields["epoch"] == epoch
    assert (fields["block_size"], fields["max_model_len"]) == ("16", "256")
    assert fields["model"] == Path(tiny_model_dir).name
    assert fields["kv_blocks_total"] == "64"
    assert int(fields["num_running"]) == 0 and int(fields["num_waiting"]) == 0
    assert float(fields["updated_at"]) > time.time() - 10
    assert 0 < redis_client.ttl(key) <= redis_schema.REGISTRY_TTL_S
    blocks_ttl = redis_client.ttl(redis_schema.blocks_key("schema-1", epoch))
    assert 0 < blocks_ttl <= redis_schema.BLOCKS_TTL_S
    assert redis_client.sismember(redis_schema.ENGINES_SET, "schema-1")


def test_evictions_shrink_the_block_set(start_engine, redis_server, redis_client):
    # 3 blocks; each request (47 prompt tokens computed: 2 full blocks + 1 partial) needs all.
    engine = start_engine(redis_server.url, "evict-1", num_kv_blocks=3, max_model_len=48)
    first, second = make_prompt(9, 47), make_prompt(10, 47)
    epoch = engine.server.epoch
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        run(stub, gen_request("evict-a", first, 1))
        first_hashes = set(hash_token_blocks(first, BLOCK_SIZE))
        wait_until(lambda: blocks_of(redis_client, "evict-1", epoch) == first_hashes)
        run(stub, gen_request("evict-b", second, 1))
    second_hashes = set(hash_token_blocks(second, BLOCK_SIZE))
    wait_until(lambda: blocks_of(redis_client, "evict-1", epoch) == second_hashes)
    cached = engine.in_engine_thread(engine.server.async_engine.cached_block_hashes)
    assert set(cached) == second_hashes


def test_restart_with_same_id_takes_new_epoch_and_drops_old_blocks(
    start_engine, redis_server, redis_client
):
    old = start_engine(redis_server.url, "restart-1")
    with grpc.insecure_channel(old.address) as channel:
        run(engine_pb2_grpc.EngineStub(channel), gen_request("r", make_prompt(11, 40), 1))
    old_epoch = old.server.epoch
    old_key = redis_schema.blocks_key("restart-1", old_epoch)
    wait_until(lambda: redis_client.scard(old_key) == 2)
    old.stop(deregister=False)  # like a crash: keys stay until their TTLs
    assert redis_client.exists(old_key)

    new = start_engine(redis_server.url, "restart-1")
    assert new.server.epoch != old_epoch
    key = redis_schema.engine_key("restart-1")
    wait_until(lambda: redis_client.hget(key, "epoch") == new.server.epoch.encode())
    assert not redis_client.exists(old_key)
    assert redis_client.hget(key, "address") == new.address.encode()


def test_serving_survives_redis_outage_and_republishes_on_return(tiny_model_dir, start_engine):
    with RedisServer() as private_redis:
        client = redis.Redis.from_url(private_redis.url, socket_timeout=5)
        engine = start_engine(private_redis.url, "outage-1")
        epoch = engine.server.epoch
        before, during = make_prompt(12, 40), make_prompt(13, 40)
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            run(stub, gen_request("o-1", before, 1))
            wait_until(lambda: client.scard(redis_schema.blocks_key("outage-1", epoch)) == 2)

            private_redis.stop()
            wait_until(lambda: not engine.server.publisher.registered.is_set())
            assert len(tokens_of(run(stub, gen_request("o-2", during, 8)))) == 8

            private_redis.start()  # same port, empty dataset
            started = time.monotonic()
            key = redis_schema.engine_key("outage-1")
            wait_until(lambda: client.exists(key), timeout_s=5)
            reregistered_s = time.monotonic() - started
        cached = set(engine.in_engine_thread(engine.server.async_engine.cached_block_hashes))
        assert set(hash_token_blocks(during, BLOCK_SIZE)) <= cached
        assert blocks_of(client, "outage-1", epoch) == cached
        assert reregistered_s < 5
        client.close()


# -- graceful shutdown of a real process -----------------------------------------------------


def test_sigterm_finishes_in_flight_stream_deregisters_and_exits_0(
    tiny_model_dir, redis_server, redis_client, tmp_path
):
    port_file = tmp_path / "port"
    command = [
        sys.executable, "-m", "engine.service.server", "--model", str(tiny_model_dir),
        "--engine-id", "sigterm-1", "--redis-url", redis_server.url, "--host", "127.0.0.1",
        "--port", "0", "--port-file", str(port_file), "--dtype", "float32",
        "--max-model-len", "512", "--num-kv-blocks", "64", "--grace-period", "20",
    ]
    log_path = tmp_path / "engine.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: port_file.exists() or process.poll() is not None, timeout_s=60)
        assert process.poll() is None, log_path.read_text()
        address = f"127.0.0.1:{int(port_file.read_text())}"
        key = redis_schema.engine_key("sigterm-1")
        wait_until(lambda: redis_client.exists(key))
        with grpc.insecure_channel(address, options=SMALL_WINDOW) as channel, \
                grpc.insecure_channel(address) as control:
            call = engine_pb2_grpc.EngineStub(channel).Generate(
                gen_request("long", make_prompt(14, 20), 300), timeout=60
            )
            received = list(next(call).token_ids)
            process.send_signal(signal.SIGTERM)
            # Not reading: flow control keeps the stream open on the server while it drains.
            health = health_pb2_grpc.HealthStub(control)
            wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                       == health_pb2.HealthCheckResponse.NOT_SERVING)
            wait_until(lambda: not redis_client.exists(key))  # deregistered while in flight
            with pytest.raises(grpc.RpcError) as refused:
                run(engine_pb2_grpc.EngineStub(control), gen_request("late", [5, 6], 2))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            responses = list(call)
        received += tokens_of(responses)
        assert len(received) == 300
        assert responses[-1].finish_reason == "length"
        assert process.wait(TIMEOUT_S) == 0, log_path.read_text()
        assert not redis_client.sismember(redis_schema.ENGINES_SET, "sigterm-1")
        assert "while 1 RPC(s) finish" in log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
