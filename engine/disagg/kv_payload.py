"""Block contents of the paged KV cache as bytes, for moving a request's KV between engines.

Role: the torch side of a KV handoff. `gather_blocks` copies blocks out of the per-layer
caches (prefill engine, right after the step that computed them) layer-major, one copy into
one buffer (a block-major gather needs two more of tens of MB, on the engine thread); the
buffer comes from an `ExportMemory`: warm private memory (`ExportBuffers`), or a warm
shared-memory segment that a same-host transfer names as it is (no second copy).
`block_bytes` turns a block block-major for the wire; `scatter_blocks`
(block-major) and `scatter_layer_major` (the export's own order) write received blocks into
reserved ones (decode engine). `BlockFormat` names the wire layout.

Invariants:
- `gather_blocks` runs on the engine thread between steps (the caches belong to the step
  loop), like the host tier's copies (engine.kv_tiers.offload); the scatters write only
  blocks reserved for an import, which no step touches (engine.core.kv_handoff).
- One block on the wire is every layer's K and V, shaped [num_layers, 2, block_size,
  num_kv_heads, head_dim], C-contiguous, in the cache's own dtype: the bytes are the cache's
  bytes, so a round trip is exact (layer-major: the same bytes, [num_layers, 2, num_blocks,
  ...]).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy
import torch

if TYPE_CHECKING:
    from engine.disagg.shm import Segment

_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


@dataclass(frozen=True)
class BlockFormat:
    """A block's wire layout: dtype name and shape [layers, 2, block_size, heads, head_dim]."""

    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor]) -> BlockFormat:
        first = caches[0]
        name = str(first.dtype).removeprefix("torch.")
        return cls(name, (len(caches), first.shape[0], *first.shape[2:]))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def num_bytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass(frozen=True)
class ExportBuffer:
    """Memory an export is gathered into: a flat uint8 `tensor`, the shared-memory
    `segment` it views (None: private memory), and `release`, called once nothing reads
    the export any more with whether the memory may serve another export (False: a
    receiver may still be reading the segment, so it must go)."""

    tensor: torch.Tensor
    release: Callable[[bool], None]
    segment: Segment | None = None


class ExportMemory(Protocol):
    """Where exports are gathered (engine thread): private buffers (`ExportBuffers`), or
    shared-memory segments a same-host transfer sends as they are
    (engine.disagg.shm_connector)."""

    def take(self, num_bytes: int) -> ExportBuffer: ...


class ExportBuffers:
    """Warm private memory for exports (a fresh tens-of-MB tensor costs more in page faults
    than the gather itself): `take` on the engine thread, release from any thread once
    nothing reads the export any more; at most `max_idle` kept. A buffer never released is
    simply freed by Python."""

    def __init__(self, max_idle: int = 2) -> None:
        self._max_idle = max_idle
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> ExportBuffer:
        tensor = self._take(num_bytes)
        # Private memory nobody else maps: reusable whatever became of the transfer.
        return ExportBuffer(tensor, lambda _reusable: self._give_back(tensor))

    def _take(self, num_bytes: int) -> torch.Tensor:
        with self._lock:
            fitting = [b for b in self._idle if b.numel() >= num_bytes]
            if fitting:
                buffer = min(fitting, key=lambda b: b.numel())
                self._idle = [b for b in self._idle if b is not buffer]
                return buffer
        return torch.empty(num_bytes, dtype=torch.uint8)

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buffer)
            self._idle.sort(key=lambda b: b.numel())
            del self._idle[: max(0, len(self._idle) - self._max_idle)]  # keep the largest


@torch.inference_mode()
def gather_blocks(
    caches: Sequence[torch.Tensor], block_ids: Sequence[int], buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks' KV on the CPU, layer-major: [layers, 2, num_blocks, block_size, heads,
    head_dim], in the start of `buffer` (flat uint8, large enough) if given."""
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=caches[0].device)
    first = caches[0]
    shape = (len(caches), first.shape[0], len(block_ids), *first.shape[2:])
    if buffer is None:
        out = torch.empty(shape, dtype=first.dtype)
    else:
        count = first.element_size()
        for size in shape:
            count *= size
        out = buffer[:count].view(first.dtype).view(shape)
    for layer, cache in enumerate(caches):
        if cache.device == out.device:
            torch.index_select(cache, 1, index, out=out[layer])
        else:  # a GPU cache: select there, one copy down
            out[layer].copy_(cache.index_select(1, index))
    return out


@dataclass(frozen=True)
class KVExport:
    """A prefill-only request's KV on the CPU, as `gather_blocks` returns it (layer-major:
    [layers, 2, num_blocks, block_size, heads, head_dim])."""

    blocks: torch.Tensor
    fmt: BlockFormat
    num_tokens: int  # positions with KV (the prompt)
    block_size: int
    block_hashes: tuple[bytes, ...]  # its full blocks'
    num_cached_tokens: int
    # Hands `blocks`' memory back (ExportBuffer.release): call once nothing reads them, with
    # whether the transfer succeeded (a receiver may still read a failed one's segment).
    release: Callable[[bool], None] | None = None
    # The shared-memory segment `blocks` lie at the start of (engine.disagg.shm), if any:
    # a same-host transfer names it instead of copying the blocks into one.
    segment: Segment | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[2])

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.fmt.num_bytes


def block_bytes(blocks: torch.Tensor, index: int) -> bytes:
    """Block `index` of a `gather_blocks` result, as wire bytes."""
    # numpy gathers the strided block in one single-threaded copy; torch's contiguous()
    # spreads 60 small pieces over its intra-op threads and then needs a second copy.
    return blocks[:, :, index].view(torch.uint8).numpy().tobytes()


def blocks_from_bytes(chunks: Sequence[bytes], fmt: BlockFormat) -> torch.Tensor:
    """Wire bytes back to [num_blocks, *fmt.shape] (CPU, one copy); ValueError on a wrong
    size."""
    for chunk in chunks:
        if len(chunk) != fmt.num_bytes:
            raise ValueError(f"KV block has {len(chunk)} bytes, expected {fmt.num_bytes}")
    out = torch.empty((len(chunks), fmt.num_bytes), dtype=torch.uint8)
    rows = out.numpy()
    for row, chunk in enumerate(chunks):
        # numpy reads the immutable bytes in place (torch.frombuffer wants them writable).
        rows[row] = numpy.frombuffer(chunk, dtype=numpy.uint8)
    return out.view(fmt.torch_dtype).view(len(chunks), *fmt.shape)


@torch.inference_mode()
def scatter_blocks(
    caches: Sequence[torch.Tensor], block_ids: Sequence[int], blocks: torch.Tensor
) -> None:
    """Write [n, layers, 2, ...] blocks into the caches' blocks `block_ids` (in order)."""
    device = caches[0].device
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    for layer, cache in enumerate(caches):
        # [n, 2, bs, h, d] -> [2, n, bs, h, d]: the cache's block axis is dim 1.
        cache.index_copy_(1, index, blocks[:, layer].transpose(0, 1).to(device))


@torch.inference_mode()
def scatter_layer_major(
    caches: Sequence[torch.Tensor], block_ids: Sequence[int], blocks: torch.Tensor
) -> None:
    """Write layer-major blocks ([layers, 2, n, ...], as `gather_blocks` returns them) into
    the caches' blocks `block_ids` (in order): each layer's source is already in the
    cache's own layout, so every copy reads whole blocks in a row."""
    device = caches[0].device
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    for layer, cache in enumerate(caches):
        cache.index_copy_(1, index, blocks[layer].to(device))
