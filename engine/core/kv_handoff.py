"""The engine's side of a prefill/decode handoff (engine.disagg): export and import of KV.

Role: `KVHandoff` gets from `LLMEngine` the parts it needs (the KV manager, the per-layer
caches, the host-tier buffer) and does the block work of a handoff: copy out the KV of
prefill-only requests that just handed off (`export`, into the memory the server chose:
its connector's shared-memory segments, so a same-host push copies nothing more), reserve
and fill blocks for a transfer (`begin_import`, then `copy_in` off the engine thread, paced
against the steps by `pacer`, and `finish_import`, or `write_import` on it; `imports` keeps
the books), and hand a complete import's blocks to the request that continues it (`adopt`).

Invariants (engine thread only, between steps, except `copy_in`):
- `copy_in` runs on the handoff's own copier thread while steps go on: it writes only
  blocks reserved for an import, which no step reads or writes and nothing else can
  allocate until the import is freed; the receiver frees an import only once its copies
  ended (engine.disagg.import_writer).
- `export` runs right after the step's results are applied, before anything allocates: the
  handed-off request's blocks were freed by then but still hold its KV (the partial last
  block sits first in the free queue, the full ones stay cached).
- `begin_import` applies the pending host-tier copies right after reserving: reserving may
  have evicted cached blocks whose KV the host tier still has to save before it is
  overwritten.
- An import's blocks are adopted by exactly one request or freed; a request that cannot
  adopt them (different prompt length or hashes) frees them and fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import RequestUpdate
from engine.disagg.copy_pacer import CopyPacer
from engine.disagg.kv_imports import KVImports, owner_key
from engine.disagg.kv_payload import (
    BlockFormat,
    ExportBuffers,
    ExportMemory,
    KVExport,
    gather_blocks,
    scatter_blocks,
    scatter_layer_major,
)
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
        # One thread: imports' copies run one after another, beside the steps.
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-import")
        # The engine's steps, entered around each forward pass: the copier's batches wait
        # their turn there.
        self.pacer = CopyPacer()
        # Warm memory for exports, back once their transfer ended (engine.disagg.prefill);
        # shared-memory segments once the server names its connector's (use_export_memory).
        self._export_memory: ExportMemory = ExportBuffers()

    def use_export_memory(self, memory: ExportMemory) -> None:
        """Gather later exports into `memory` (before the engine serves: engine thread)."""
        self._export_memory = memory

    def export(self, updates: Sequence[RequestUpdate]) -> None:
        """Copy out the KV of the prefill-only requests among `updates` that handed off."""
        block_size = self._kv.block_size
        for update in updates:
            request = update.request
            if not (update.finished and request.status is RequestStatus.FINISHED_HANDOFF):
                continue
            num_full = request.num_prompt_tokens // block_size
            fmt = BlockFormat.of(self._caches)
            buffer = self._export_memory.take(len(request.handoff_block_ids) * fmt.num_bytes)
            request.exported_kv = KVExport(
                gather_blocks(self._caches, request.handoff_block_ids, buffer.tensor),
                fmt, request.num_prompt_tokens, block_size,
                tuple(request.block_hashes[:num_full]), request.num_cached_tokens or 0,
                buffer.release, buffer.segment,
            )

    def begin_import(
        self, transfer_id: str, num_blocks: int, num_tokens: int, block_hashes: list[bytes],
        first_block: int = 0,
    ) -> list[int]:
        """Reserve a transfer's blocks (engine.disagg.kv_imports)."""
        if num_blocks != -(-num_tokens // self._kv.block_size):
            raise ValueError(f"{num_blocks} blocks cannot hold exactly {num_tokens} tokens")
        block_ids = self.imports.begin(transfer_id, num_blocks, num_tokens, block_hashes,
                                       first_block)
        self._apply_host_copies()
        return block_ids

    def write_import(self, transfer_id: str, indexes: list[int], blocks: torch.Tensor) -> None:
        """Write received blocks ([n, layers, 2, ...] on the CPU) into the import's blocks."""
        targets = self.imports.write_targets(transfer_id, indexes)
        self._apply_host_copies()
        scatter_blocks(self._caches, targets, blocks)

    def copy_in(
        self, block_ids: list[int], blocks: Callable[[], torch.Tensor], layer_major: bool = False,
        paced: bool = False,
    ) -> Future[None]:
        """Write the blocks `blocks()` makes ([n, layers, 2, ...], or [layers, 2, n, ...] if
        `layer_major`) into reserved blocks `block_ids`, both on the copier thread (any
        thread may call; see the module's invariants); `paced`: after waiting for a step
        that no other paced copy runs beside (engine.disagg.copy_pacer)."""
        scatter = scatter_layer_major if layer_major else scatter_blocks

        def copy() -> None:
            if paced:
                self.pacer.turn()
            scatter(self._caches, block_ids, blocks())
        return self._copier.submit(copy)

    def finish_import(self, transfer_id: str, indexes: list[int]) -> None:
        """Record the blocks `copy_in` wrote and mark the import complete."""
        self.imports.write_targets(transfer_id, indexes)
        self.imports.complete(transfer_id)

    def _apply_host_copies(self) -> None:
        if self._host_kv is not None and self._kv.transfers:
            self._host_kv.apply(self._kv.transfers.take())

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
