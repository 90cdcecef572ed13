"""The one definition of a KV block's hash, shared by engines and routers.

A block's hash commits to every token before it: h_i = H(h_{i-1} or ROOT, tokens of block i,
extra keys). Extra keys carry what makes KV differ for the same tokens: the LoRA adapter id (every
block) and a cache salt (the tenant; first block only, so it taints the whole chain). H is a
128-bit blake2b over a fixed little-endian encoding, so every process and every machine agrees;
Python's `hash()` would not (randomised per process).

This module must not import torch: the router imports it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

DIGEST_SIZE = 16
# A fixed, documented root so that the first block's hash is reproducible anywhere.
ROOT_HASH: BlockHash = hashlib.blake2b(b"kvfleet.block_hash.v1", digest_size=DIGEST_SIZE).digest()


def _encode_text(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + struct.pack("<I", len(raw)) + raw


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    *,
    cache_salt: str | None = None,
    lora_id: str | None = None,
) -> BlockHash:
    """Hash one full block chained to its parent (None for the first block)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(ROOT_HASH if parent is None else parent)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(_encode_text(lora_id))
    # The salt only enters the first block; its effect propagates through the chain.
    h.update(_encode_text(cache_salt if parent is None else None))
    return h.digest()


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora_id: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, starting at block index `start_block`.

    `parent` is the hash of block `start_block - 1` when resuming an existing chain.
    """
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(parent, block, cache_salt=cache_salt, lora_id=lora_id)
        hashes.append(parent)
    return hashes
