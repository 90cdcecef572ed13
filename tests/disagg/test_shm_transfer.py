"""The same-host transport on its own (engine.disagg.shm, engine.disagg.shm_connector): the
bytes a decode engine holds after a transfer are the bytes sent, by shared memory or gRPC;
`auto` falls back to gRPC for a decode engine on another host and remembers it; a sender
reuses a segment only after a transfer succeeded; a receiver opens only its own host's
segments, by name, and refuses the rest clearly; segments never outlive their sender (its
close, or the sweep after it was killed)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from engine.disagg import shm
from engine.disagg.grpc_connector import GrpcKVConnector
from engine.disagg.kv_imports import owner_key
from engine.disagg.kv_payload import BlockFormat, KVExport, gather_blocks
from engine.disagg.shm_connector import SameHostKVConnector
from engine.disagg.transfer import KVTransfer
from kvfleet.v1 import engine_pb2, engine_pb2_grpc
from tests.fixtures.engine_harness import (
    EngineHarness,
    engine_options,
    gen_request,
    make_prompt,
    wait_all_blocks_free,
)
from tests.fixtures.servers import RedisServer

TIMEOUT_S = 30.0
NUM_TOKENS = 70  # 5 blocks, the last one partial


@pytest.fixture(scope="module")
def decode(tiny_model_dir: Path, redis_server: RedisServer) -> Iterator[EngineHarness]:
    options = engine_options(tiny_model_dir, redis_server.url, "shm-d0")
    harness = EngineHarness(options.__class__(**{**options.__dict__, "role": "decode"}))
    yield harness.start()
    harness.stop()


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    yield
    assert shm.segments_of(shm.DEFAULT_SHM_DIR, os.getpid()) == []


def _fmt(decode: EngineHarness) -> BlockFormat:
    return BlockFormat.of(decode.server.async_engine.engine.runner.kv_caches)


def _export(decode: EngineHarness, seed: int) -> KVExport:
    fmt = _fmt(decode)
    generator = torch.Generator().manual_seed(seed)
    layers, kv, block_size, heads, head_dim = fmt.shape  # layer-major, as gather_blocks
    blocks = torch.randn((layers, kv, 5, block_size, heads, head_dim),
                         generator=generator).to(fmt.torch_dtype)
    return KVExport(blocks, fmt, NUM_TOKENS, 16, (), 0)


def _send(connector: SameHostKVConnector, transfer: KVTransfer) -> engine_pb2.KVTransferResult:
    async def go() -> engine_pb2.KVTransferResult:
        try:
            return await connector.send(transfer)
        finally:
            await connector.close()
    return asyncio.run(go())


def _held(decode: EngineHarness, transfer_id: str) -> torch.Tensor:
    """The blocks the decode engine holds for a complete import, then frees them."""
    llm = decode.server.async_engine.engine

    def read() -> torch.Tensor:
        entry = llm.handoff.imports.take(transfer_id)
        blocks = gather_blocks(llm.runner.kv_caches, entry.block_ids)
        llm.kv.release(owner_key(transfer_id))
        return blocks
    return decode.in_engine_thread(read)


@pytest.mark.parametrize("mode,host,transport", [
    ("shm", None, "shm"), ("grpc", None, "grpc"), ("auto", None, "shm"),
    ("auto", "another-host/0", "grpc"),
])
def test_decode_engine_holds_the_bytes_sent(decode, mode, host, transport):
    export = _export(decode, seed=len(mode) + (host is not None))
    connector = SameHostKVConnector(GrpcKVConnector(), mode, host_id=host)
    transfer_id = f"bytes-{mode}-{host is not None}"
    transfer = KVTransfer(transfer_id, gen_request("r", make_prompt(1, NUM_TOKENS), 4),
                          export, decode.address, TIMEOUT_S)
    result = _send(connector, transfer)
    assert (result.transport, result.num_blocks) == (transport, 5)
    assert result.num_bytes == 5 * export.fmt.num_bytes
    assert torch.equal(_held(decode, transfer_id), export.blocks)
    if host is not None:  # remembered as remote: the next transfer goes straight to gRPC
        assert connector.remote_destinations == {decode.address}
        assert _send(connector, transfer_again(transfer)).transport == "grpc"
        _held(decode, transfer.transfer_id + "-again")
    wait_all_blocks_free(_stub(decode))


def test_segment_is_reused_after_success_and_dropped_after_failure(decode):
    """Two transfers through one warm segment (the receiver leaves it to the sender); a
    refused one unlinks it; close unlinks what is kept."""
    connector = SameHostKVConnector(GrpcKVConnector(), "shm")
    export = _export(decode, 11)
    request = gen_request("r", make_prompt(4, NUM_TOKENS), 4)
    seen = []

    async def go() -> None:
        for attempt in range(2):
            await connector.send(KVTransfer(f"reuse-{attempt}", request, export,
                                            decode.address, TIMEOUT_S))
            seen.append(shm.segments_of(shm.DEFAULT_SHM_DIR, os.getpid()))
        with pytest.raises(grpc.aio.AioRpcError):  # reuse-0 is still held: refused
            await connector.send(KVTransfer("reuse-0", request, export, decode.address,
                                            TIMEOUT_S))
        seen.append(shm.segments_of(shm.DEFAULT_SHM_DIR, os.getpid()))
        await connector.send(KVTransfer("reuse-2", request, export, decode.address,
                                        TIMEOUT_S))
        await connector.close()

    asyncio.run(go())
    assert len(seen[0]) == 1 and seen[1] == seen[0]  # one segment, used twice
    assert seen[2] == []  # the refused transfer's segment is gone
    for attempt in range(3):
        assert torch.equal(_held(decode, f"reuse-{attempt}"), export.blocks)
    wait_all_blocks_free(_stub(decode))


def transfer_again(transfer: KVTransfer) -> KVTransfer:
    return KVTransfer(transfer.transfer_id + "-again", transfer.request, transfer.export,
                      transfer.destination, transfer.timeout_s)


def test_forced_shm_to_another_host_fails_without_fallback(decode):
    connector = SameHostKVConnector(GrpcKVConnector(), "shm", host_id="another-host/0")
    transfer = KVTransfer("forced", gen_request("r", make_prompt(2, NUM_TOKENS), 4),
                          _export(decode, 7), decode.address, TIMEOUT_S)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _send(connector, transfer)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "shm.host_id" in (info.value.details() or "")
    wait_all_blocks_free(_stub(decode))


def _stub(harness: EngineHarness) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(grpc.insecure_channel(harness.address))


def _header(decode: EngineHarness, transfer_id: str, spec: engine_pb2.KVSharedMemory,
            ) -> engine_pb2.KVTransferChunk:
    fmt = _fmt(decode)
    return engine_pb2.KVTransferChunk(header=engine_pb2.KVTransferHeader(
        transfer_id=transfer_id, request_id=transfer_id, prompt_token_ids=make_prompt(3, 40),
        block_size=16, num_blocks=3, num_tokens=40, dtype=fmt.dtype, block_shape=fmt.shape,
        shm=spec,
    ))


@pytest.mark.parametrize("name,host,code,field", [
    ("../../etc/passwd", None, grpc.StatusCode.INVALID_ARGUMENT, "shm.name"),
    (f"kvfleet-kv.0000abcd.{os.getpid()}.{'0' * 32}", None, grpc.StatusCode.NOT_FOUND,
     "shm.name"),
    (None, "another-host/0", grpc.StatusCode.NOT_FOUND, "shm.host_id"),
])
def test_receiver_refuses_segments_it_must_not_or_cannot_open(decode, name, host, code, field):
    segment = shm.create(shm.DEFAULT_SHM_DIR, 3 * _fmt(decode).num_bytes)
    try:
        spec = engine_pb2.KVSharedMemory(name=name or segment.name,
                                         host_id=host or shm.host_id(),
                                         num_bytes=segment.capacity)
        with pytest.raises(grpc.RpcError) as info:
            _stub(decode).ReceiveKV(iter([_header(decode, f"refuse-{field}", spec)]),
                                    timeout=TIMEOUT_S)
        assert info.value.code() == code
        assert field in (info.value.details() or "")
        assert segment.path.exists()  # not opened, so not unlinked
    finally:
        segment.close()
        segment.unlink()
    wait_all_blocks_free(_stub(decode))


def test_receiver_unlinks_a_one_shot_segment_even_if_the_sender_never_does(decode):
    """A one-shot segment (not reused) is the receiver's to remove once mapped."""
    fmt = _fmt(decode)
    segment = shm.create(shm.DEFAULT_SHM_DIR, 3 * fmt.num_bytes)
    wire = torch.arange(segment.capacity // 4, dtype=torch.float32).view(3, *fmt.shape)
    segment.tensor(segment.capacity).copy_(wire.view(torch.uint8).reshape(-1))
    blocks = wire.permute(1, 2, 0, 3, 4, 5)  # held blocks read back layer-major
    segment.close()
    spec = engine_pb2.KVSharedMemory(name=segment.name, host_id=shm.host_id(),
                                     num_bytes=segment.capacity)
    reply = _stub(decode).ReceiveKV(iter([_header(decode, "orphan", spec)]), timeout=TIMEOUT_S)
    assert reply.num_blocks == 3
    assert not segment.path.exists()
    assert torch.equal(_held(decode, "orphan"), blocks)
    wait_all_blocks_free(_stub(decode))


_CREATE_AND_HANG = """
import sys, time
from pathlib import Path
from engine.disagg import shm
segment = shm.create(Path(sys.argv[1]), 4096)
print(segment.name, flush=True)
time.sleep(60)
"""


def test_sweep_removes_segments_of_killed_engines_only(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _CREATE_AND_HANG, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    orphan = child.stdout.readline().strip()
    mine = shm.create(tmp_path, 4096)
    try:
        assert shm.sweep(tmp_path) == []  # its creator is alive
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert shm.sweep(tmp_path) == [orphan]
        assert sorted(p.name for p in tmp_path.iterdir()) == [mine.name]
    finally:
        mine.close()
        mine.unlink()


def test_receiver_keeps_reused_segments_mapped_until_their_sender_unlinks(tmp_path):
    maps = shm.MappedSegments(tmp_path, max_kept=2)
    first, second, third = (shm.create(tmp_path, 4096) for _ in range(3))
    try:
        first.tensor(4).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        mapped, owned = maps.open(first.name, 4, reused=True)
        assert not owned and maps.open(first.name, 4, reused=True)[0] is mapped
        assert mapped.tensor(4).tolist() == [1, 2, 3, 4]
        first.tensor(1).fill_(9)  # the sender's next transfer, through the same pages
        assert mapped.tensor(4).tolist() == [9, 2, 3, 4]
        maps.open(second.name, 4, reused=True)
        maps.open(third.name, 4, reused=True)
        assert len(maps) == 2  # the least recently used (first) went
        third.unlink()  # its sender dropped it: so does the receiver, at the next open
        maps.open(second.name, 4, reused=True)
        assert len(maps) == 1
        with pytest.raises(ValueError, match="shm.num_bytes"):
            maps.open(first.name, 8192, reused=True)
        one_shot, owned = maps.open(first.name, 4, reused=False)
        assert owned and not first.path.exists()
        one_shot.close()
    finally:
        maps.close()
        for segment in (first, second, third):
            segment.close()
            segment.unlink()


def test_no_segment_here_sends_bytes_in_auto_and_fails_in_shm(decode, tmp_path):
    """/dev/shm full or missing (here: missing): auto sends that transfer over gRPC."""
    export = _export(decode, 13)
    request = gen_request("r", make_prompt(5, NUM_TOKENS), 4)
    auto = SameHostKVConnector(GrpcKVConnector(), "auto", shm_dir=tmp_path / "missing")
    result = _send(auto, KVTransfer("no-shm", request, export, decode.address, TIMEOUT_S))
    assert result.transport == "grpc"
    assert auto.remote_destinations == frozenset()  # the destination itself is not remote
    assert torch.equal(_held(decode, "no-shm"), export.blocks)
    forced = SameHostKVConnector(GrpcKVConnector(), "shm", shm_dir=tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        _send(forced, KVTransfer("no-shm-2", request, export, decode.address, TIMEOUT_S))
    wait_all_blocks_free(_stub(decode))


def test_export_buffers_are_reused_once_released():
    from engine.disagg.kv_payload import ExportBuffers

    buffers = ExportBuffers(max_idle=2)
    first = buffers.take(1000)
    assert first.segment is None
    assert buffers.take(1000).tensor is not first.tensor  # still out
    first.release(False)  # private memory: reusable even after a failed transfer
    again = buffers.take(800)
    assert again.tensor is first.tensor  # fits: reused
    small, big = buffers.take(10), buffers.take(5000)
    for buffer in (again, small, big):
        buffer.release(True)
    assert buffers.take(1).tensor is first.tensor  # the smallest kept one that fits;
    assert buffers.take(1).tensor is big.tensor  # `small` was dropped
    assert buffers.take(1).tensor is not small.tensor


def test_export_gathered_into_a_segment_is_sent_as_it_is(decode):
    """With the connector's export memory the export lies in a segment already: the
    transfer names it (no second segment, no copy), layer-major; after a successful
    transfer the segment serves the next export, after a failed one it is unlinked."""
    connector = SameHostKVConnector(GrpcKVConnector(), "shm")
    memory = connector.export_memory()
    source = _export(decode, 17)
    num_bytes = source.num_bytes

    def exported() -> KVExport:
        buffer = memory.take(num_bytes)
        blocks = buffer.tensor[:num_bytes].view(source.fmt.torch_dtype).view(source.blocks.shape)
        blocks.copy_(source.blocks)
        return KVExport(blocks, source.fmt, NUM_TOKENS, 16, (), 0, buffer.release,
                        buffer.segment)

    request = gen_request("r", make_prompt(6, NUM_TOKENS), 4)
    seen: list[list[str]] = []

    async def go() -> tuple[KVExport, engine_pb2.KVTransferResult]:
        first = exported()
        try:
            result = await connector.send(KVTransfer("in-place", request, first,
                                                     decode.address, TIMEOUT_S))
            seen.append(shm.segments_of(shm.DEFAULT_SHM_DIR, os.getpid()))
            assert first.release is not None
            first.release(True)
            second = exported()
            assert second.segment is first.segment  # warm: reused
            assert second.release is not None
            second.release(False)  # as after a failed transfer: a receiver may still read it
            seen.append(shm.segments_of(shm.DEFAULT_SHM_DIR, os.getpid()))
            return first, result
        finally:
            await connector.close()

    first, result = asyncio.run(go())
    assert (result.transport, result.num_blocks) == ("shm", 5)
    assert first.segment is not None and seen[0] == [first.segment.name]
    assert seen[1] == []
    assert torch.equal(_held(decode, "in-place"), source.blocks)
    wait_all_blocks_free(_stub(decode))


def test_an_export_dropped_unreleased_has_its_segment_unlinked(tmp_path):
    """A Prefill call cancelled between the export and the push never releases it: the
    segment file must not stay in /dev/shm."""
    import gc

    connector = SameHostKVConnector(GrpcKVConnector(), "shm", shm_dir=tmp_path)
    buffer = connector.export_memory().take(4096)
    assert buffer.segment is not None
    assert [p.name for p in tmp_path.iterdir()] == [buffer.segment.name]
    del buffer
    gc.collect()
    assert list(tmp_path.iterdir()) == []
    asyncio.run(connector.close())
