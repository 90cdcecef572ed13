"""Writes a transfer's blocks into the decode engine's reserved blocks, beside the steps.

Role: `ImportWriter` takes blocks as they arrive (gRPC chunks, or slices of a shared-memory
segment) and has the handoff's copier thread write them (`KVHandoff.copy_in`), so a decode
step never waits for an import's copy, and the event loop only awaits. It keeps which block
indexes were written, for `KVHandoff.finish_import`.

Invariants: one copy in flight per writer (each `write` awaits its own); an index outside
the transfer's sent blocks is a ValueError before anything is written; `after_copies` runs
its callback only once no copy of this writer can still touch the blocks, so the caller can
free them there (a cancelled await does not stop a copy already on the copier thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from engine.core.kv_handoff import KVHandoff


class ImportWriter:
    def __init__(self, handoff: KVHandoff, block_ids: list[int], first_block: int) -> None:
        self._handoff = handoff
        self._block_ids = block_ids
        self._first_block = first_block
        self._in_flight: Future[None] | None = None
        self.written: list[int] = []

    async def write(
        self, indexes: Sequence[int], blocks: Callable[[], torch.Tensor], layer_major: bool = False,
        paced: bool = False,
    ) -> None:
        """Copy what `blocks` makes ([n, layers, 2, ...], or [layers, 2, n, ...] if
        `layer_major`; CPU; called on the copier thread, so turning bytes into a tensor holds
        no step up either) into blocks `indexes`; `paced`: one such batch per engine step
        (KVHandoff.copy_in)."""
        targets = []
        for index in indexes:
            if not self._first_block <= index < len(self._block_ids):
                raise ValueError(f"block_index {index} is outside "
                                 f"[{self._first_block}, {len(self._block_ids)})")
            targets.append(self._block_ids[index])
        self._in_flight = self._handoff.copy_in(targets, blocks, layer_major, paced)
        await asyncio.wrap_future(self._in_flight)
        self.written.extend(indexes)

    def after_copies(self, callback: Callable[[], object]) -> None:
        """Call `callback` (on the copier thread, or here) once no copy is in flight."""
        if self._in_flight is None or self._in_flight.done():
            callback()
        else:
            self._in_flight.add_done_callback(lambda _: callback())
