"""The simplest exact KV transport: the decode engine's ReceiveKV, blocks as bytes over gRPC.

Role: `GrpcKVConnector` implements `engine.disagg.transfer.KVConnector` with one
client-streaming call per transfer (header, then one chunk per block), a channel per
destination kept for the engine's life, and the fleet's engine credential on every call.
With TLS (the fleet's mutual TLS, kvfleet.runtime.tls) it dials with the engine's own
certificate and accepts a peer whose certificate carries the engines' role name.

Invariants: a failed or timed-out call raises (grpc.aio.AioRpcError); the receiver then
frees what it reserved, and the sender holds nothing but the export, dropped with the call.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc.aio

from engine.disagg.transfer import KVTransfer, block_chunks, transfer_header, transfer_result
from kvfleet.runtime.tls import ClientTls, aio_channel
from kvfleet.runtime.tracing import trace_metadata
from kvfleet.v1 import engine_pb2, engine_pb2_grpc

# A block of a big model is a few MB; leave room above gRPC's 4 MB default.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


class GrpcKVConnector:
    def __init__(
        self, credential: tuple[tuple[str, str], ...] = (), tls: ClientTls | None = None
    ) -> None:
        self._credential = credential
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, destination: str) -> engine_pb2_grpc.EngineStub:
        channel = self._channels.get(destination)
        if channel is None:
            channel = aio_channel(destination, self._tls, options=CHANNEL_OPTIONS)
            self._channels[destination] = channel
        return engine_pb2_grpc.EngineStub(channel)

    async def send(self, transfer: KVTransfer) -> engine_pb2.KVTransferResult:
        start = time.monotonic()
        export = transfer.export

        async def chunks() -> AsyncIterator[engine_pb2.KVTransferChunk]:
            yield engine_pb2.KVTransferChunk(
                header=transfer_header(export, transfer.transfer_id, transfer.request,
                                       transfer.first_block)
            )
            for block in block_chunks(export, transfer.first_block):
                yield engine_pb2.KVTransferChunk(block=block)

        reply = await self.receive_kv(transfer, chunks())
        return transfer_result(transfer, reply, time.monotonic() - start, "grpc")

    async def receive_kv(
        self, transfer: KVTransfer, chunks: AsyncIterator[engine_pb2.KVTransferChunk]
    ) -> engine_pb2.ReceiveKVResponse:
        """One ReceiveKV call to the transfer's destination (other transports' control
        channel too: engine.disagg.shm_connector sends its header through it)."""
        return await self._stub(transfer.destination).ReceiveKV(
            chunks, timeout=transfer.timeout_s,
            metadata=trace_metadata() + self._credential,
        )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
