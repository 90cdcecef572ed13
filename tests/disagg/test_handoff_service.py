"""The handoff over gRPC between two in-process engines: Prefill pushes the KV (ReceiveKV),
GenerateImported continues; text and tokens equal one engine's Generate, and every block on
both sides ends free, also when a transfer fails, is cut short or is never claimed. Every
test runs with both transports (`--kv-transfer shm`: same-host shared memory, and `grpc`),
and no shared-memory segment is left behind."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from engine.disagg import shm
from engine.disagg.kv_payload import BlockFormat
from kvfleet.v1 import engine_pb2, engine_pb2_grpc
from tests.fixtures.engine_harness import (
    EngineHarness,
    engine_options,
    gen_request,
    make_prompt,
    run,
    tokens_of,
    wait_all_blocks_free,
    wait_until,
)
from tests.fixtures.servers import RedisServer

TIMEOUT_S = 30.0


@pytest.fixture(scope="module", params=["shm", "grpc"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, redis_server: RedisServer,
            transport: str) -> Iterator[tuple[EngineHarness, ...]]:
    started = []
    for engine_id, role in (("p0", "prefill"), ("d0", "decode")):
        options = engine_options(tiny_model_dir, redis_server.url, engine_id,
                                 max_num_batched_tokens=32)
        changes = {"role": role, "kv_transfer": transport}
        started.append(EngineHarness(options.__class__(**{**options.__dict__, **changes}))
                       .start())
    yield tuple(started)
    for harness in started:
        harness.stop()
    # Stopped: the prefill engine's kept segments are gone too.
    assert shm.segments_of(shm.DEFAULT_SHM_DIR, os.getpid()) == []


@pytest.fixture(autouse=True)
def segments_bounded() -> Iterator[None]:
    yield
    # What a test leaves is at most what the prefill engine keeps for reuse (failed
    # transfers' segments are unlinked at once).
    assert len(shm.segments_of(shm.DEFAULT_SHM_DIR, os.getpid())) <= shm.DEFAULT_MAX_IDLE


def _stub(harness: EngineHarness) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(grpc.insecure_channel(harness.address))


def _disaggregated(prefill: EngineHarness, decode: EngineHarness,
                   request: engine_pb2.GenerateRequest, transfer_id: str, skip_blocks: int = 0,
                   ) -> tuple[list[int], str, engine_pb2.GenerateResponse]:
    responses = list(_stub(prefill).Prefill(engine_pb2.PrefillRequest(
        request=request, decode_address=decode.address, transfer_id=transfer_id,
        skip_blocks=skip_blocks,
    ), timeout=TIMEOUT_S))
    first = responses[0].output
    assert not first.HasField("finish_reason")
    num_blocks = -(-len(request.prompt_token_ids) // 16)
    num_full = len(request.prompt_token_ids) // 16
    assert responses[-1].transfer.num_blocks == num_blocks - min(skip_blocks, num_full)
    assert responses[-1].transfer.transport == prefill.server.options.kv_transfer
    rest = list(_stub(decode).GenerateImported(engine_pb2.ImportedGenerateRequest(
        request=request, transfer_id=transfer_id, first_token_id=first.token_ids[0],
    ), timeout=TIMEOUT_S))
    tokens = list(first.token_ids) + tokens_of(rest)
    text = first.text_delta + "".join(r.text_delta for r in rest)
    return tokens, text, rest[-1]


@pytest.mark.parametrize("length", [5, 16, 50, 90])
def test_handoff_equals_colocated(engines, length):
    prefill, decode = engines
    prompt = make_prompt(length, length)
    colocated = run(_stub(decode), gen_request(f"c{length}", prompt, 12))
    for attempt in range(2):  # the second one hits both prefix caches, and sends only
        skip = attempt * (length - 1) // 16  # what the decode engine lacks
        tokens, text, last = _disaggregated(
            prefill, decode, gen_request(f"d{length}-{attempt}", prompt, 12),
            f"t{length}-{attempt}", skip,
        )
        assert tokens == tokens_of(colocated)
        assert text == "".join(r.text_delta for r in colocated)
        assert last.finish_reason == "length"
        assert last.usage.completion_tokens == 12
        assert last.usage.prompt_tokens == length
    for harness in engines:
        wait_all_blocks_free(_stub(harness))


def test_first_token_that_ends_the_request_sends_nothing(engines):
    prefill, decode = engines
    responses = list(_stub(prefill).Prefill(engine_pb2.PrefillRequest(
        request=gen_request("one", make_prompt(1, 40), 1), decode_address=decode.address,
        transfer_id="t-one",
    ), timeout=TIMEOUT_S))
    assert len(responses) == 1
    assert responses[0].output.finish_reason == "length"


def test_unknown_transfer_is_unavailable(engines):
    _, decode = engines
    with pytest.raises(grpc.RpcError) as info:
        list(_stub(decode).GenerateImported(engine_pb2.ImportedGenerateRequest(
            request=gen_request("x", make_prompt(2, 20), 4), transfer_id="nope",
            first_token_id=5,
        ), timeout=TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_all_blocks_free(_stub(decode))


def test_transfer_to_a_dead_address_fails_and_frees(engines):
    prefill, _ = engines
    with pytest.raises(grpc.RpcError) as info:
        list(_stub(prefill).Prefill(engine_pb2.PrefillRequest(
            request=gen_request("dead", make_prompt(3, 40), 8),
            decode_address="127.0.0.1:1", transfer_id="t-dead", transfer_timeout_s=2.0,
        ), timeout=TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_all_blocks_free(_stub(prefill))


class _HangingReceiver(engine_pb2_grpc.EngineServicer):
    """A decode engine that takes the header and then never answers."""

    def ReceiveKV(self, request_iterator, context):  # noqa: N802 - gRPC's name
        next(request_iterator)
        time.sleep(10)
        return engine_pb2.ReceiveKVResponse()


def test_transfer_timeout_fails_and_frees(engines):
    prefill, _ = engines
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_EngineServicer_to_server(_HangingReceiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(_stub(prefill).Prefill(engine_pb2.PrefillRequest(
                request=gen_request("slow", make_prompt(5, 40), 8),
                decode_address=f"127.0.0.1:{port}", transfer_id="t-slow",
                transfer_timeout_s=1.0,
            ), timeout=TIMEOUT_S))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "t-slow" in (info.value.details() or "")
        assert time.monotonic() - started < 8
    finally:
        server.stop(0)
    wait_all_blocks_free(_stub(prefill))


def test_stream_cut_mid_transfer_frees_reserved_blocks(engines):
    """The sender dies after the header and one block: the receiver frees what it reserved."""
    _, decode = engines
    fmt = BlockFormat.of(decode.server.async_engine.engine.runner.kv_caches)
    header = engine_pb2.KVTransferHeader(
        transfer_id="cut", request_id="cut", prompt_token_ids=make_prompt(4, 40),
        block_size=16, num_blocks=3, num_tokens=40, dtype=fmt.dtype, block_shape=fmt.shape,
    )

    def chunks() -> Iterator[engine_pb2.KVTransferChunk]:
        yield engine_pb2.KVTransferChunk(header=header)
        yield engine_pb2.KVTransferChunk(block=engine_pb2.KVBlockChunk(
            block_index=0, data=bytes(fmt.num_bytes)))
        raise RuntimeError("sender died")

    with pytest.raises(grpc.RpcError):
        _stub(decode).ReceiveKV(chunks(), timeout=TIMEOUT_S)
    wait_all_blocks_free(_stub(decode))
    imports = decode.server.async_engine.engine.handoff.imports
    assert decode.in_engine_thread(lambda: len(imports)) == 0


def test_sender_gone_while_the_reservation_runs_frees_it(engines, monkeypatch):
    """The sender dies while the decode engine thread is inside the reservation (a busy
    engine: the cancelled call can no longer be skipped): the blocks it then reserves are
    freed right after, not left until some later transfer's expiry."""
    _, decode = engines
    handoff = decode.server.async_engine.engine.handoff
    inside, go_on = threading.Event(), threading.Event()
    reserve = handoff.begin_import

    def held_reservation(*args, **kwargs):  # runs on the engine thread
        inside.set()
        go_on.wait(TIMEOUT_S)
        return reserve(*args, **kwargs)

    monkeypatch.setattr(handoff, "begin_import", held_reservation)
    fmt = BlockFormat.of(decode.server.async_engine.engine.runner.kv_caches)
    header = engine_pb2.KVTransferHeader(
        transfer_id="gone", request_id="gone", prompt_token_ids=make_prompt(6, 40),
        block_size=16, num_blocks=3, num_tokens=40, dtype=fmt.dtype, block_shape=fmt.shape,
    )
    failed_before = _failed_receives(decode)

    def chunks() -> Iterator[engine_pb2.KVTransferChunk]:
        yield engine_pb2.KVTransferChunk(header=header)
        assert inside.wait(TIMEOUT_S)
        raise RuntimeError("sender died")

    try:
        with pytest.raises(grpc.RpcError):
            _stub(decode).ReceiveKV(chunks(), timeout=TIMEOUT_S)
        # The handler has seen the cancellation before the reservation goes on.
        wait_until(lambda: _failed_receives(decode) > failed_before)
    finally:
        go_on.set()
    wait_all_blocks_free(_stub(decode))
    imports = handoff.imports
    assert decode.in_engine_thread(lambda: len(imports)) == 0


def _failed_receives(harness: EngineHarness) -> float:
    return sum(sample.value for metric in harness.server.metrics.registry.collect()
               for sample in metric.samples
               if sample.name == "kvfleet:kv_transfers_total"
               and sample.labels.get("side") == "receive"
               and sample.labels.get("outcome") == "failed")


def test_roles_are_published_and_transfers_counted(engines, redis_server):
    import redis

    from kvfleet.contracts import redis_schema

    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    def roles() -> dict[str, bytes | str | None] | None:
        got = {e: client.hget(redis_schema.engine_key(e), "role") for e in ("p0", "d0")}
        return got if None not in got.values() else None

    assert wait_until(roles) == {"p0": b"prefill", "d0": b"decode"}
    prefill, decode = engines
    _disaggregated(prefill, decode, gen_request("m", make_prompt(9, 33), 3), "t-m")
    sent = _sample(prefill, "kvfleet:kv_transfer_sent_bytes_total")
    received = _sample(decode, "kvfleet:kv_transfer_received_bytes_total")
    fmt = BlockFormat.of(decode.server.async_engine.engine.runner.kv_caches)
    assert sent >= 3 * fmt.num_bytes
    assert received == sent
    blocks = [sample for metric in prefill.server.metrics.registry.collect()
              for sample in metric.samples if sample.name == "kvfleet:kv_transfer_blocks_total"]
    assert {sample.labels["transport"] for sample in blocks} == {prefill.server.options.kv_transfer}
    assert sum(sample.value for sample in blocks) * fmt.num_bytes == sent


def _sample(harness: EngineHarness, name: str) -> float:
    return sum(sample.value for metric in harness.server.metrics.registry.collect()
               for sample in metric.samples if sample.name == name)


def test_refused_transfer_fails_and_frees_both_sides(engines):
    """The decode engine refuses the KV (the blocks to skip are not cached there): the
    Prefill call fails after its first token, nothing stays reserved, no segment is left."""
    prefill, decode = engines
    with pytest.raises(grpc.RpcError) as info:
        list(_stub(prefill).Prefill(engine_pb2.PrefillRequest(
            request=gen_request("refused", make_prompt(11, 50), 8),
            decode_address=decode.address, transfer_id="t-refused", skip_blocks=2,
        ), timeout=TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "t-refused" in (info.value.details() or "")
    for harness in engines:
        wait_all_blocks_free(_stub(harness))
