"""A request's exported KV and the connector interface that moves it between engines.

Role: `KVExport` is what a prefill-only request leaves behind when it hands off (its blocks'
contents, copied on the engine thread, plus what the receiver needs to check and cache
them); `KVConnector` is the one seam a transport plugs into (this package's gRPC streaming
connector, engine.disagg.grpc_connector, or a NIXL/UCX/LMCache-style one): send a request's
blocks to a named decode engine and report what was sent.

Invariants: an export is immutable once built and owns CPU memory only (the prefill engine
has already freed the blocks it came from); `header` describes exactly the blocks that
`block_bytes` yields, in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from engine.disagg.kv_payload import KVExport, block_bytes
from kvfleet.v1 import engine_pb2


def transfer_header(
    export: KVExport, transfer_id: str, request: engine_pb2.GenerateRequest, first_block: int = 0,
) -> engine_pb2.KVTransferHeader:
    return engine_pb2.KVTransferHeader(
        transfer_id=transfer_id, request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids, cache_salt=request.cache_salt,
        lora_id=request.lora_id, block_size=export.block_size, num_blocks=export.num_blocks,
        num_tokens=export.num_tokens, dtype=export.fmt.dtype, block_shape=list(export.fmt.shape),
        block_hashes=list(export.block_hashes), first_block=first_block,
    )


def transfer_result(
    transfer: KVTransfer, reply: engine_pb2.ReceiveKVResponse, seconds: float, transport: str,
) -> engine_pb2.KVTransferResult:
    """What was sent, once the receiver's reply says it took every block (else raises)."""
    export = transfer.export
    sent = export.num_blocks - transfer.first_block
    if reply.num_blocks != sent:
        raise RuntimeError(f"decode engine took {reply.num_blocks} of {sent} blocks")
    return engine_pb2.KVTransferResult(
        transfer_id=transfer.transfer_id, num_blocks=sent,
        num_bytes=sent * export.fmt.num_bytes, seconds=seconds,
        num_cached_tokens=export.num_cached_tokens, transport=transport,
    )


def block_chunks(export: KVExport, first_block: int = 0) -> Iterator[engine_pb2.KVBlockChunk]:
    for index in range(first_block, export.num_blocks):
        yield engine_pb2.KVBlockChunk(block_index=index, data=block_bytes(export.blocks, index))


@dataclass(frozen=True)
class KVTransfer:
    """One handoff: which request's KV goes where, under which id, within how long."""

    transfer_id: str
    request: engine_pb2.GenerateRequest
    export: KVExport
    destination: str  # the decode engine's host:port
    timeout_s: float
    # Leading full blocks the destination already caches (not sent).
    skip_blocks: int = 0

    @property
    def first_block(self) -> int:
        """The first block sent: never past the full blocks (the receiver finds skipped
        ones by hash)."""
        return min(self.skip_blocks, len(self.export.block_hashes))


class KVConnector(Protocol):
    """Moves a request's KV blocks to a decode engine (which allocates them on arrival,
    frees them if the transfer fails, and holds them for GenerateImported)."""

    async def send(self, transfer: KVTransfer) -> engine_pb2.KVTransferResult:
        """Send every block; raises when the receiver did not take them all."""
        ...

    async def close(self) -> None: ...
