"""The KV transfer's own cost per block, apart from prefill compute (benchmarks.disagg_bench).

Role: pushes a `--long-tokens` prompt's worth of blocks (random contents, the engine's block
format) from this process to one idle engine of a running fleet, through the engines' own
connector (engine.disagg.shm_connector) forced to one transport, `repeats` times, and
reports the end-to-end time per block: bytes written (gRPC; shm: none, the export lies in
the connector's segment as an engine gathers it), ReceiveKV, the engine's reservation, its
copy into the cache and its completion (two waits for a step boundary).
Each import is then claimed by a GenerateImported of one token so its blocks come free.

Invariant: the blocks are claimed under a fresh random prompt each time, with no block
hashes sent, so nothing the fleet caches is overwritten.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
import torch

from engine.disagg.grpc_connector import GrpcKVConnector
from engine.disagg.kv_payload import BlockFormat, KVExport
from engine.disagg.shm_connector import SameHostKVConnector
from engine.disagg.transfer import KVTransfer
from kvfleet.runtime.service_auth import credential_metadata, read_secret
from kvfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc

BLOCK_SIZE = 16


@dataclass(frozen=True)
class TransferCost:
    transport: str
    num_blocks: int
    block_bytes: int
    seconds_per_block: float  # median over the repeats

    def line(self) -> str:
        rate = self.block_bytes / self.seconds_per_block / 1e9
        return (f"{self.transport:>4}: {self.seconds_per_block * 1e6:.0f} us per "
                f"{self.block_bytes / 1024:.0f} KiB block, {rate:.2f} GB/s "
                f"({self.num_blocks} blocks a transfer)")


def block_format(model_dir: Path, dtype: str = "float32") -> BlockFormat:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return BlockFormat(dtype, (config["num_hidden_layers"], 2, BLOCK_SIZE, kv_heads, head_dim))


async def measure(address: str, secret_file: Path, fmt: BlockFormat, transport: str,
                  num_tokens: int, repeats: int) -> TransferCost:
    credential = credential_metadata(read_secret(secret_file))
    connector = SameHostKVConnector(GrpcKVConnector(credential), transport)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    layers, kv, block_size, heads, head_dim = fmt.shape  # layer-major, as gather_blocks
    shape = (layers, kv, num_blocks, block_size, heads, head_dim)
    # Where an engine gathers its exports (for shm: one of the connector's segments, which
    # the transfer then names as it is); the gather itself is the prefill engine's step's.
    buffer = connector.export_memory().take(num_blocks * fmt.num_bytes)
    blocks = buffer.tensor[:num_blocks * fmt.num_bytes].view(fmt.torch_dtype).view(shape)
    blocks.copy_(torch.randn(shape).to(fmt.torch_dtype))
    export = KVExport(blocks, fmt, num_tokens, BLOCK_SIZE, (), 0, buffer.release, buffer.segment)
    rng = random.Random(transport)
    times = []
    try:
        for attempt in range(repeats):
            prompt = [rng.randrange(3, 500) for _ in range(num_tokens)]
            request = engine_pb2.GenerateRequest(
                request_id=f"cost-{transport}-{attempt}", prompt_token_ids=prompt,
                sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=2,
                                                 ignore_eos=True))
            transfer = KVTransfer(request.request_id, request, export, address, 60.0)
            start = time.perf_counter()
            await connector.send(transfer)
            times.append(time.perf_counter() - start)
            await _claim(address, credential, request)
    finally:
        buffer.release(True)
        await connector.close()
    times.sort()
    return TransferCost(transport, num_blocks, fmt.num_bytes, times[len(times) // 2] / num_blocks)


async def _claim(address: str, credential: tuple[tuple[str, str], ...],
                 request: engine_pb2.GenerateRequest) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        call = stub.GenerateImported(engine_pb2.ImportedGenerateRequest(
            request=request, transfer_id=request.request_id, first_token_id=5,
        ), metadata=credential, timeout=60.0)
        async for _ in call:
            pass


def run(address: str, secret_file: Path, model_dir: Path, transports: list[str],
        num_tokens: int, repeats: int) -> list[TransferCost]:
    fmt = block_format(model_dir)
    return [asyncio.run(measure(address, secret_file, fmt, transport, num_tokens, repeats))
            for transport in transports]
