"""The decode side of a KV transfer: a ReceiveKV stream into reserved blocks.

Role: `receive_kv` turns the stream into block writes: reserve the blocks when the header
arrives (engine thread), write the blocks as they come (gRPC chunks) or from the
shared-memory segment the header names (same host, engine.disagg.shm) on the handoff's
copier thread (engine.disagg.import_writer), mark the import complete at the end (engine
thread). Whatever goes wrong (a bad header, a short or failed stream, the sender gone, a
segment that is not here) frees the reserved blocks, once no copy touches them, before the
error goes back; a sender gone while the engine thread is making the reservation has it
freed right after it is made.

Invariants: every KV manager change runs on the engine thread (`call_in_engine_thread`);
steps never wait for an import's copy, and a segment's batches run one per step; bytes are
turned into tensors on the copier thread;
a one-shot segment is unlinked as soon as it is mapped (a reused one is the sender's
to remove); a header naming another host's segment is
refused with NOT_FOUND before anything is reserved (the sender then sends bytes). An
import that completes but is never claimed is freed by `KVImports.expire` at its deadline,
checked by a timer set here.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from engine.disagg import shm
from engine.disagg.import_writer import ImportWriter
from engine.disagg.kv_imports import DEFAULT_IMPORT_TIMEOUT_S
from engine.disagg.kv_payload import BlockFormat, blocks_from_bytes
from engine.service.async_engine import AsyncEngine
from kvfleet.contracts.errors import NotFoundError
from kvfleet.v1 import engine_pb2

T = TypeVar("T")
# gRPC blocks per copy: fewer thread hops, bounded memory.
WRITE_BATCH = 8
# Segment blocks per copy: a cancelled transfer stops within one batch, and a layer-major
# segment's batches are paced one per engine step (engine.disagg.copy_pacer).
SHM_COPY_BATCH = 32


@dataclass(frozen=True)
class ReceivedKV:
    num_blocks: int
    num_bytes: int


@dataclass(frozen=True)
class ShmAccess:
    """Where this engine finds same-host segments (and keeps senders' reused ones mapped;
    event loop only), and which host it is on."""

    segments: shm.MappedSegments = field(
        default_factory=lambda: shm.MappedSegments(shm.DEFAULT_SHM_DIR))
    host_id: str = field(default_factory=shm.host_id)


async def receive_kv(
    engine: AsyncEngine, chunks: AsyncIterator[engine_pb2.KVTransferChunk], block_size: int,
    access: ShmAccess | None = None,
) -> ReceivedKV:
    first = await anext(chunks, None)
    if first is None or not first.HasField("header"):
        raise ValueError("a KV transfer starts with its header")
    header = first.header
    fmt = _check_header(header, block_size)
    llm = engine.engine
    own = BlockFormat.of(llm.runner.kv_caches)  # shapes fixed at start: safe to read here
    if fmt != own:
        raise ValueError(f"KV blocks are {fmt}, this engine's are {own} (same model and "
                         "dtype on both sides?)")
    segment, owned = (_open_segment(header, fmt, access or ShmAccess())
                      if header.HasField("shm") else (None, False))
    transfer_id = header.transfer_id
    try:
        block_ids = await _reserve(engine, functools.partial(
            llm.handoff.begin_import, transfer_id, header.num_blocks, header.num_tokens,
            list(header.block_hashes), header.first_block,
        ), functools.partial(llm.handoff.imports.abort, transfer_id))
        _expire_later(engine)
        writer = ImportWriter(llm.handoff, block_ids, header.first_block)
        try:
            if segment is None:
                await _write_chunks(writer, chunks, fmt)
            else:
                await _write_segment(writer, segment, header, fmt)
            await _on_engine(engine, functools.partial(
                llm.handoff.finish_import, transfer_id, list(writer.written)))
        except BaseException:
            abort = functools.partial(llm.handoff.imports.abort, transfer_id)
            writer.after_copies(lambda: engine.call_in_engine_thread(abort))
            raise
    finally:
        if segment is not None and owned:
            segment.close()
    _expire_later(engine)
    return ReceivedKV(len(writer.written), len(writer.written) * fmt.num_bytes)


def _open_segment(
    header: engine_pb2.KVTransferHeader, fmt: BlockFormat, access: ShmAccess
) -> tuple[shm.Segment, bool]:
    spec = header.shm
    if spec.host_id != access.host_id:
        raise NotFoundError(f"shm.host_id: the segment is on host {spec.host_id!r}, this "
                            f"engine on {access.host_id!r}")
    sent = header.num_blocks if spec.layer_major else header.num_blocks - header.first_block
    expected = sent * fmt.num_bytes
    if spec.num_bytes != expected:
        raise ValueError(f"shm.num_bytes: {spec.num_bytes}, the blocks take {expected}")
    try:
        return access.segments.open(spec.name, spec.num_bytes, spec.reused)
    except FileNotFoundError as exc:  # same host id, another /dev/shm (a container)
        raise NotFoundError(f"shm.name: no segment {spec.name!r} here") from exc


async def _write_segment(
    writer: ImportWriter, segment: shm.Segment, header: engine_pb2.KVTransferHeader,
    fmt: BlockFormat,
) -> None:
    first, total = header.first_block, header.num_blocks
    if header.shm.layer_major:  # the export as gathered: each layer's blocks in a row
        layers, kv, *block = fmt.shape
        blocks = (segment.tensor(total * fmt.num_bytes).view(fmt.torch_dtype)
                  .view(layers, kv, total, *block))
        for start in range(first, total, SHM_COPY_BATCH):
            stop = min(start + SHM_COPY_BATCH, total)
            await writer.write(range(start, stop),
                               functools.partial(_same, blocks[:, :, start:stop]),
                               layer_major=True, paced=True)
        return
    count = total - first
    blocks = segment.tensor(count * fmt.num_bytes).view(fmt.torch_dtype).view(count, *fmt.shape)
    for start in range(first, total, SHM_COPY_BATCH):
        stop = min(start + SHM_COPY_BATCH, total)
        batch = blocks[start - first:stop - first]
        await writer.write(range(start, stop), functools.partial(_same, batch))


async def _write_chunks(
    writer: ImportWriter, chunks: AsyncIterator[engine_pb2.KVTransferChunk], fmt: BlockFormat,
) -> None:
    indexes: list[int] = []
    data: list[bytes] = []
    async for chunk in chunks:
        if not chunk.HasField("block"):
            raise ValueError("a KV transfer has one header")
        indexes.append(chunk.block.block_index)
        data.append(chunk.block.data)
        if len(indexes) >= WRITE_BATCH:
            await writer.write(indexes, functools.partial(blocks_from_bytes, data, fmt))
            indexes, data = [], []
    if indexes:
        await writer.write(indexes, functools.partial(blocks_from_bytes, data, fmt))


def _same(blocks: torch.Tensor) -> torch.Tensor:
    return blocks


def _check_header(header: engine_pb2.KVTransferHeader, block_size: int) -> BlockFormat:
    if header.block_size != block_size:
        raise ValueError(f"block_size {header.block_size} differs from this engine's "
                         f"({block_size})")
    fmt = BlockFormat(header.dtype, tuple(header.block_shape))
    if header.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {header.dtype!r} is not a KV cache dtype")
    return fmt


async def _on_engine(engine: AsyncEngine, fn: Callable[[], T]) -> T:
    return await asyncio.wrap_future(engine.call_in_engine_thread(fn))


async def _reserve(engine: AsyncEngine, reserve: Callable[[], T], release: Callable[[], object],
                   ) -> T:
    """`reserve` on the engine thread; if this call is cancelled meanwhile (the sender gone
    right after its header, while a busy engine thread had not reached the reservation), the
    reservation still happens there, so `release` follows it once it succeeded."""
    future = engine.call_in_engine_thread(reserve)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        # Only a reservation that was made is released: one refused (a duplicate transfer id)
        # must not free the live transfer of that id.
        future.add_done_callback(
            lambda done: None if done.cancelled() or done.exception() is not None
            else engine.call_in_engine_thread(release))
        raise


def _expire_later(engine: AsyncEngine) -> None:
    """Free imports past their deadline soon after it (unclaimed or stalled transfers)."""
    loop = asyncio.get_running_loop()
    llm = engine.engine
    loop.call_later(DEFAULT_IMPORT_TIMEOUT_S + 0.5,
                    lambda: engine.call_in_engine_thread(llm.handoff.imports.expire))
