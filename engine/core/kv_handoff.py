"""The engine's side of a prefill/decode handoff (engine.disagg): export and import of KV.

Role: `KVHandoff` gets from `LLMEngine` the parts it needs (the KV manager, the per-layer
caches, the host-tier buffer) and does the block work of a handoff: copy out the KV of
prefill-only requests that just handed off (`export`), reserve and fill blocks for a
transfer (`begin_import`, `write_import`, via `imports`), and hand a complete import's
blocks to the request that continues it (`adopt`).

Invariants (engine thread only, between steps):
- `export` runs right after the step's results are applied, before anything allocates: the
  handed-off request's blocks were freed by then but still hold its KV (the partial last
  block sits first in the free queue, the full ones stay cached).
- Writing into reserved blocks first applies the pending host-tier copies: reserving may
  have evicted cached blocks whose KV the host tier still has to save.
- An import's blocks are adopted by exactly one request or freed; a request that cannot
  adopt them (different prompt length or hashes) frees them and fails.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import RequestUpdate
from engine.disagg.kv_imports import KVImports, owner_key
from engine.disagg.kv_payload import BlockFormat, KVExport, gather_blocks, scatter_blocks
from engine.kv_tiers.offload import HostKVBuffer


class KVHandoff:
    def __init__(
        self, kv: KVCacheManager, caches: list[torch.Tensor], host_kv: HostKVBuffer | None,
    ) -> None:
        self._kv = kv
        self._caches = caches
        self._host_kv = host_kv
        # KV received from prefill engines, waiting for their requests.
        self.imports = KVImports(kv, time.monotonic)

    def export(self, updates: Sequence[RequestUpdate]) -> None:
        """Copy out the KV of the prefill-only requests among `updates` that handed off."""
        block_size = self._kv.block_size
        for update in updates:
            request = update.request
            if not (update.finished and request.status is RequestStatus.FINISHED_HANDOFF):
                continue
            num_full = request.num_prompt_tokens // block_size
            request.exported_kv = KVExport(
                gather_blocks(self._caches, request.handoff_block_ids),
                BlockFormat.of(self._caches), request.num_prompt_tokens, block_size,
                tuple(request.block_hashes[:num_full]), request.num_cached_tokens or 0,
            )

    def begin_import(
        self, transfer_id: str, num_blocks: int, num_tokens: int, block_hashes: list[bytes],
        first_block: int = 0,
    ) -> list[int]:
        """Reserve a transfer's blocks (engine.disagg.kv_imports)."""
        if num_blocks != -(-num_tokens // self._kv.block_size):
            raise ValueError(f"{num_blocks} blocks cannot hold exactly {num_tokens} tokens")
        return self.imports.begin(transfer_id, num_blocks, num_tokens, block_hashes,
                                  first_block)

    def write_import(self, transfer_id: str, indexes: list[int], blocks: torch.Tensor) -> None:
        """Write received blocks ([n, layers, 2, ...] on the CPU) into the import's blocks."""
        targets = self.imports.write_targets(transfer_id, indexes)
        if self._host_kv is not None and self._kv.transfers:
            self._host_kv.apply(self._kv.transfers.take())
        scatter_blocks(self._caches, targets, blocks)

    def adopt(self, request: Request, transfer_id: str) -> None:
        """Give `request` (its first token appended) the KV of a complete import: its prompt
        counts as computed and its full blocks enter the prefix cache."""
        imported = self.imports.take(transfer_id)
        owner = owner_key(transfer_id)
        problem = None
        if imported.num_tokens != request.num_prompt_tokens:
            problem = (f"the KV holds {imported.num_tokens} tokens, the prompt has "
                       f"{request.num_prompt_tokens}")
        elif imported.block_hashes != request.block_hashes[: len(imported.block_hashes)]:
            problem = ("the KV's block hashes differ from this engine's for the prompt "
                       "(cache salt, adapter or block size differ)")
        if problem is not None:
            self._kv.release(owner)
            raise ValueError(problem)
        request.num_computed_tokens = imported.num_tokens
        request.kv_imported = True
        self._kv.adopt(owner, request)
