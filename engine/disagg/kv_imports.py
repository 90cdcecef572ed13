"""KV imports on a decode engine: blocks reserved for a transfer until a request adopts them.

Role: the engine-thread bookkeeping of `ReceiveKV` and `GenerateImported`. A transfer's
header reserves its blocks (`begin`), its chunks are written into them (`write`), its end
marks it complete (`complete`), and `GenerateImported` takes the blocks for its request
(`take`). Everything that does not reach `take` is released: a failed or cancelled stream
(`abort`), or a complete import nobody claimed within `timeout_s` (`expire`).

Invariants:
- Engine thread only (the KV manager and the caches belong to the step loop).
- Every reserved block is owned by exactly one live import, under the KV manager owner key
  `owner_key(transfer_id)`, until adopted by a request or freed; `check_integrity` of the KV
  manager counts them as owned.
- A transfer id is live at most once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.kv_cache_manager import KVCacheManager
from kvfleet.contracts.errors import OverloadedError, UnavailableError

OWNER_PREFIX = "\x00kv-import:"
DEFAULT_IMPORT_TIMEOUT_S = 30.0


def owner_key(transfer_id: str) -> str:
    """The KV manager owner of an import's blocks (no request id starts with NUL)."""
    return OWNER_PREFIX + transfer_id


class MissingImportError(UnavailableError):
    """GenerateImported named a transfer that failed, expired or never completed here; the
    router falls back to recomputing (UNAVAILABLE)."""


@dataclass(frozen=True)
class ImportedStart:
    """How a decode engine's request starts: after `first_token_id`, with the KV received
    under `transfer_id` (empty: recompute the prompt)."""

    first_token_id: int
    transfer_id: str = ""
    num_cached_tokens: int = 0


@dataclass
class KVImport:
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    block_hashes: list[bytes]
    deadline: float
    written: set[int] = field(default_factory=set)
    complete: bool = False
    # Blocks before it are cached blocks shared with others: never written.
    first_block: int = 0


class KVImports:
    def __init__(
        self, kv: KVCacheManager, clock: Callable[[], float],
        timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S,
    ) -> None:
        self._kv = kv
        self._clock = clock
        self._timeout_s = timeout_s
        self._imports: dict[str, KVImport] = {}

    def __len__(self) -> int:
        return len(self._imports)

    def begin(
        self, transfer_id: str, num_blocks: int, num_tokens: int, block_hashes: list[bytes],
        first_block: int = 0,
    ) -> list[int]:
        """Reserve the transfer's blocks; their ids in order. The first `first_block` are
        this engine's cached blocks of those hashes (no chunk comes for them;
        MissingImportError if one is no longer cached). OverloadedError if they do not fit,
        ValueError for a live transfer id."""
        if not transfer_id or transfer_id in self._imports:
            raise ValueError(f"transfer_id {transfer_id!r} is empty or already in use")
        if not 0 <= first_block <= min(len(block_hashes), num_blocks):
            raise ValueError(f"first_block {first_block} is past the full blocks")
        prefix = self._kv.cached_blocks(block_hashes[:first_block])
        if prefix is None:
            raise MissingImportError("the skipped blocks are no longer cached here")
        blocks = self._kv.reserve(owner_key(transfer_id), num_blocks - first_block, prefix)
        if blocks is None:
            raise OverloadedError(
                f"no room for {num_blocks} KV blocks ({self._kv.num_free_blocks} free)"
            )
        block_ids = [block.block_id for block in blocks]
        self._imports[transfer_id] = KVImport(
            transfer_id, block_ids, num_tokens, list(block_hashes),
            self._clock() + self._timeout_s, first_block=first_block,
        )
        return block_ids

    def write_targets(self, transfer_id: str, indexes: list[int]) -> list[int]:
        """The block ids chunks `indexes` go to (recorded as written); ValueError if unknown."""
        entry = self._live(transfer_id)
        for index in indexes:
            if not entry.first_block <= index < len(entry.block_ids):
                raise ValueError(f"block_index {index} is outside "
                                 f"[{entry.first_block}, {len(entry.block_ids)})")
        entry.written.update(indexes)
        return [entry.block_ids[index] for index in indexes]

    def complete(self, transfer_id: str) -> None:
        """Every block arrived: the import may be taken until its deadline."""
        entry = self._live(transfer_id)
        missing = len(entry.block_ids) - entry.first_block - len(entry.written)
        if missing:
            raise ValueError(f"transfer {transfer_id!r} ended with {missing} block(s) missing")
        entry.complete = True
        entry.deadline = self._clock() + self._timeout_s

    def take(self, transfer_id: str) -> KVImport:
        """A complete import, handed to its request (the caller adopts the blocks)."""
        entry = self._imports.get(transfer_id)
        if entry is None or not entry.complete:
            raise MissingImportError(
                f"no complete KV transfer {transfer_id!r} here (it failed or expired)"
            )
        del self._imports[transfer_id]
        return entry

    def abort(self, transfer_id: str) -> bool:
        """Free a transfer's blocks (its stream failed); False if not live."""
        if self._imports.pop(transfer_id, None) is None:
            return False
        self._kv.release(owner_key(transfer_id))
        return True

    def expire(self) -> list[str]:
        """Free every import past its deadline; their transfer ids."""
        now = self._clock()
        gone = [tid for tid, entry in self._imports.items() if entry.deadline <= now]
        for transfer_id in gone:
            self.abort(transfer_id)
        return gone

    def _live(self, transfer_id: str) -> KVImport:
        entry = self._imports.get(transfer_id)
        if entry is None:
            raise ValueError(f"no KV transfer {transfer_id!r} in progress")
        return entry
