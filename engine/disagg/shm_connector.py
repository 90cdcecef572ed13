"""The same-host KV transport: blocks through a shared-memory segment, a header over gRPC.

Role: `SameHostKVConnector` implements `engine.disagg.transfer.KVConnector`. For a decode
engine on this host it sends only the transfer header naming a shared-memory segment
(engine.disagg.shm) that holds the blocks, over the same ReceiveKV call the gRPC transport
uses (credential, TLS, deadline); the decode engine copies the blocks into its cache and
answers. Otherwise it sends bytes over gRPC (engine.disagg.grpc_connector). Its
`export_memory` has the prefill engine gather each export straight into a warm segment, so
the segment is named as it is, in the export's layer-major order: between the prefill
engine's cache and the decode engine's there is one copy on each side, no reordering.

Modes (`--kv-transfer`, like vLLM's kv-transfer config): `grpc` never uses shared memory;
`shm` always does (a receiver that cannot open the segment fails the transfer); `auto`
tries it and, when the receiver answers NOT_FOUND (another host: the host ids differ, or a
container without the same /dev/shm), sends that transfer over gRPC and remembers the
destination as remote; when no segment can be made here (/dev/shm full or missing), that
transfer goes over gRPC.

Invariants: a segment is reused (kept warm: faulting a fresh one's pages in costs more than
the copy) only after its transfer succeeded; after a refusal, a timeout or the receiver's
death it is unlinked at once (an export's segment when the export is released,
engine.disagg.prefill). `close` unlinks the kept ones, and any released after it. Segments
of an engine killed meanwhile are removed by the next sweep on its host (at an engine's
start).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy
import torch

from engine.disagg import shm
from engine.disagg.grpc_connector import GrpcKVConnector
from engine.disagg.kv_payload import ExportBuffer, ExportBuffers, ExportMemory
from engine.disagg.transfer import KVTransfer, transfer_header, transfer_result
from kvfleet.v1 import engine_pb2

KV_TRANSFER_MODES = ("auto", "shm", "grpc")
logger = logging.getLogger(__name__)


class SameHostKVConnector:
    def __init__(
        self, grpc_connector: GrpcKVConnector, mode: str = "auto",
        shm_dir: Path = shm.DEFAULT_SHM_DIR, host_id: str | None = None,
    ) -> None:
        if mode not in KV_TRANSFER_MODES:
            raise ValueError(f"kv_transfer: {mode!r} is not one of {', '.join(KV_TRANSFER_MODES)}")
        self._grpc = grpc_connector
        self._mode = mode
        self._dir = shm_dir
        self._host_id = host_id or shm.host_id()
        # Destinations that answered NOT_FOUND to a segment (auto mode): gRPC from then on.
        self._remote: set[str] = set()
        self._segments = shm.SegmentPool(shm_dir)
        if mode != "grpc":
            shm.sweep(shm_dir)

    def export_memory(self) -> ExportMemory:
        """Where the engine should gather exports (KVHandoff.use_export_memory): this
        connector's segments, unless it never uses shared memory."""
        return ExportBuffers() if self._mode == "grpc" else SegmentExports(self._segments)

    @property
    def remote_destinations(self) -> frozenset[str]:
        return frozenset(self._remote)

    async def send(self, transfer: KVTransfer) -> engine_pb2.KVTransferResult:
        nothing_to_copy = transfer.first_block >= transfer.export.num_blocks
        if self._mode == "grpc" or transfer.destination in self._remote or nothing_to_copy:
            return await self._grpc.send(transfer)  # (a header alone when nothing to copy)
        try:
            return await self._send_shm(transfer)
        except grpc.aio.AioRpcError as exc:
            if self._mode == "shm" or exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self._remote.add(transfer.destination)
        except OSError as exc:  # no room in /dev/shm, or none at all: this one goes as bytes
            if self._mode == "shm":
                raise
            logger.warning("KV transfer %s: no shared-memory segment (%s); sending over gRPC",
                           transfer.transfer_id, exc)
        return await self._grpc.send(transfer)

    async def _send_shm(self, transfer: KVTransfer) -> engine_pb2.KVTransferResult:
        start = time.monotonic()
        export = transfer.export
        segment, own = export.segment, export.segment is None
        if segment is None:  # gathered into private memory: one copy into a warm segment
            segment = self._segments.take(export.num_bytes)
        try:
            if own:  # off the event loop: a request's KV is tens of MB
                await asyncio.to_thread(_fill, segment, export.blocks)
            header = transfer_header(export, transfer.transfer_id, transfer.request,
                                     transfer.first_block)
            header.shm.CopyFrom(engine_pb2.KVSharedMemory(
                name=segment.name, host_id=self._host_id, num_bytes=export.num_bytes,
                reused=True, layer_major=True))

            async def chunks() -> AsyncIterator[engine_pb2.KVTransferChunk]:
                yield engine_pb2.KVTransferChunk(header=header)

            reply = await self._grpc.receive_kv(transfer, chunks())
        except BaseException:
            if own:  # an export's own segment goes when the export is released
                self._segments.discard(segment)
            raise
        if own:
            self._segments.keep(segment)
        return transfer_result(transfer, reply, time.monotonic() - start, "shm")

    async def close(self) -> None:
        self._segments.close()
        await self._grpc.close()


def _fill(segment: shm.Segment, blocks: torch.Tensor) -> None:
    """The export's layer-major `blocks` into the start of the segment, as they are."""
    source = blocks.contiguous().view(-1).view(torch.uint8).numpy()
    # numpy: one single-threaded copy (torch's threads only contend here).
    numpy.copyto(segment.tensor(source.size).numpy(), source)


class SegmentExports:
    """Exports gathered straight into the connector's warm segments (kv_payload's
    ExportMemory; `take` on the engine thread). Where no segment can be made (/dev/shm full
    or missing) the export goes to private memory, and a same-host transfer of it copies it
    into a segment then (or goes over gRPC). An export dropped without being released (its
    Prefill call cancelled before the push) has its segment unlinked when it is collected:
    a segment file is tens of MB of /dev/shm."""

    def __init__(self, segments: shm.SegmentPool) -> None:
        self._segments = segments
        self._private = ExportBuffers()

    def take(self, num_bytes: int) -> ExportBuffer:
        try:
            segment = self._segments.take(num_bytes)
        except OSError as exc:
            logger.warning("no shared-memory segment for a KV export (%s): private memory",
                           exc)
            return self._private.take(num_bytes)
        lease = _Lease(self._segments, segment)
        return ExportBuffer(segment.tensor(segment.capacity), lease.release, segment)


class _Lease:
    """One export's hold on a segment: back to the pool (or unlinked) on release, unlinked
    if the export is collected unreleased."""

    def __init__(self, segments: shm.SegmentPool, segment: shm.Segment) -> None:
        self._segments = segments
        self._segment = segment
        self._unreleased = weakref.finalize(self, shm.SegmentPool.discard, segment)

    def release(self, reusable: bool) -> None:
        if self._unreleased.detach() is None:
            return  # released already
        if reusable:
            self._segments.keep(self._segment)
        else:  # a receiver may still be reading it
            self._segments.discard(self._segment)
