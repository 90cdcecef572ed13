"""KVImports and the KV manager's reserve/adopt/release: exact block ids and refcounts."""

from __future__ import annotations

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.disagg.kv_imports import KVImports, MissingImportError, owner_key
from kvfleet.contracts.errors import OverloadedError
from kvfleet.contracts.sampling_params import SamplingParams


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _request(num_tokens: int) -> Request:
    return Request("r", list(range(1, num_tokens + 1)), SamplingParams(), 4, 4, 0)


def test_reserve_write_complete_adopt():
    kv, clock = KVCacheManager(8, 4), Clock()
    imports = KVImports(kv, clock, timeout_s=5)
    request = _request(10)
    assert imports.begin("t", 3, 10, request.block_hashes[:2]) == [0, 1, 2]
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [1, 1, 1]
    kv.check_integrity()
    assert imports.write_targets("t", [2, 0]) == [2, 0]
    with pytest.raises(ValueError, match="missing"):
        imports.complete("t")
    imports.write_targets("t", [1])
    imports.complete("t")
    entry = imports.take("t")
    request.num_computed_tokens = 10
    kv.adopt(owner_key(entry.transfer_id), request)
    assert kv.get_block_ids("r") == [0, 1, 2]
    assert [kv.pool.blocks[i].block_hash for i in (0, 1)] == request.block_hashes[:2]
    assert kv.pool.blocks[2].block_hash is None  # the partial block is never cached
    kv.free(request)
    assert kv.pool.num_free_blocks == 8
    # Freed: the partial block first (reused first), the cached ones at the back.
    assert kv.pool.free_queue.block_ids()[:1] == [2]
    kv.check_integrity()


def test_abort_expire_and_refusals():
    kv, clock = KVCacheManager(4, 4), Clock()
    imports = KVImports(kv, clock, timeout_s=5)
    with pytest.raises(OverloadedError):
        imports.begin("big", 5, 20, [])
    assert imports.begin("a", 2, 8, []) == [0, 1]
    with pytest.raises(ValueError):
        imports.begin("a", 1, 4, [])
    assert imports.begin("b", 2, 8, []) == [2, 3]
    assert kv.pool.num_free_blocks == 0
    assert imports.abort("a") and not imports.abort("a")
    assert kv.pool.num_free_blocks == 2
    with pytest.raises(MissingImportError):
        imports.take("b")  # not complete
    clock.now = 5.0
    assert imports.expire() == ["b"]
    assert kv.pool.num_free_blocks == 4 and len(imports) == 0
    kv.check_integrity()


def test_skipped_prefix_blocks_are_the_cached_ones_and_never_written():
    kv, clock = KVCacheManager(8, 4), Clock()
    imports = KVImports(kv, clock, timeout_s=5)
    first = _request(10)
    first.num_computed_tokens = 10
    assert imports.begin("t1", 3, 10, first.block_hashes[:2]) == [0, 1, 2]
    imports.write_targets("t1", [0, 1, 2])
    imports.complete("t1")
    imports.take("t1")
    kv.adopt(owner_key("t1"), first)
    kv.free(first)  # blocks 0 and 1 stay cached (free, ref_cnt 0)
    second = _request(10)
    # Skip the two cached blocks: they are referenced again, one fresh block for the rest.
    assert imports.begin("t2", 3, 10, second.block_hashes[:2], first_block=2) == [0, 1, 2]
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [1, 1, 1]
    with pytest.raises(ValueError, match="outside"):
        imports.write_targets("t2", [1])  # a shared cached block: never overwritten
    imports.write_targets("t2", [2])
    imports.complete("t2")
    assert imports.abort("t2")
    assert kv.pool.num_free_blocks == 8
    kv.check_integrity()
    kv.reset_prefix_cache()
    with pytest.raises(MissingImportError):
        imports.begin("t3", 3, 10, second.block_hashes[:2], first_block=2)
    assert kv.pool.num_free_blocks == 8
