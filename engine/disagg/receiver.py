"""The decode side of a KV transfer: a ReceiveKV stream into reserved blocks.

Role: `receive_kv` turns the stream (header, then block chunks) into engine-thread calls:
reserve the blocks when the header arrives, write chunks in batches, mark the import
complete at the end. Whatever goes wrong (a bad header, a short or failed stream, the
sender gone) frees the reserved blocks before the error goes back.

Invariants: every KV manager change runs on the engine thread (`call_in_engine_thread`);
bytes are turned into tensors on the event loop (a view, no copy); an import that completes
but is never claimed is freed by `KVImports.expire` at its deadline, checked by a timer set
here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from engine.disagg.kv_imports import DEFAULT_IMPORT_TIMEOUT_S
from engine.disagg.kv_payload import BlockFormat, blocks_from_bytes
from engine.service.async_engine import AsyncEngine
from kvfleet.v1 import engine_pb2

T = TypeVar("T")
# Blocks written per engine-thread call: fewer thread hops, bounded memory.
WRITE_BATCH = 8


@dataclass(frozen=True)
class ReceivedKV:
    num_blocks: int
    num_bytes: int


async def receive_kv(
    engine: AsyncEngine, chunks: AsyncIterator[engine_pb2.KVTransferChunk], block_size: int
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
    transfer_id = header.transfer_id
    await _on_engine(engine, functools.partial(
        llm.handoff.begin_import, transfer_id, header.num_blocks, header.num_tokens,
        list(header.block_hashes), header.first_block,
    ))
    _expire_later(engine)
    try:
        received = await _write_all(engine, transfer_id, chunks, fmt)
        await _on_engine(engine, functools.partial(llm.handoff.imports.complete, transfer_id))
    except BaseException:
        with contextlib.suppress(Exception):
            await _on_engine(engine, functools.partial(llm.handoff.imports.abort, transfer_id))
        raise
    _expire_later(engine)
    return ReceivedKV(received, received * fmt.num_bytes)


async def _write_all(
    engine: AsyncEngine, transfer_id: str, chunks: AsyncIterator[engine_pb2.KVTransferChunk],
    fmt: BlockFormat,
) -> int:
    indexes: list[int] = []
    data: list[bytes] = []
    received = 0
    async for chunk in chunks:
        if not chunk.HasField("block"):
            raise ValueError("a KV transfer has one header")
        indexes.append(chunk.block.block_index)
        data.append(chunk.block.data)
        if len(indexes) >= WRITE_BATCH:
            received += await _write(engine, transfer_id, indexes, data, fmt)
            indexes, data = [], []
    if indexes:
        received += await _write(engine, transfer_id, indexes, data, fmt)
    return received


async def _write(
    engine: AsyncEngine, transfer_id: str, indexes: list[int], data: list[bytes],
    fmt: BlockFormat,
) -> int:
    blocks = blocks_from_bytes(data, fmt)
    await _on_engine(engine, functools.partial(
        engine.engine.handoff.write_import, transfer_id, list(indexes), blocks
    ))
    return len(indexes)


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


def _expire_later(engine: AsyncEngine) -> None:
    """Free imports past their deadline soon after it (unclaimed or stalled transfers)."""
    loop = asyncio.get_running_loop()
    llm = engine.engine
    loop.call_later(DEFAULT_IMPORT_TIMEOUT_S + 0.5,
                    lambda: engine.call_in_engine_thread(llm.handoff.imports.expire))
