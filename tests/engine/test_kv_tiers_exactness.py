"""Greedy output under swap preemption and host-tier prefix hits equals transformers (float32).

The prompts and reference are test_exactness's. Swap is forced with a KV pool far too small
for the batch (preemption_mode="swap", room for every victim in swap space); the host tier is
exercised by a device pool that cannot keep the first round's prefixes, so the second round
reloads them from host memory. Integrity (device pool, swap space, host tier) is checked after
every step.
"""

from __future__ import annotations

import pytest

from engine import LLM
from tests.engine.test_exactness import (  # noqa: F401  (fixtures)
    GREEDY,
    NEW_TOKENS,
    prompts,
    reference,
    run_checked,
)


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({"max_num_batched_tokens": 64}, id="swap-chunked-64"),
        pytest.param({"max_num_batched_tokens": 16, "max_num_seqs": 4}, id="swap-chunked-16"),
        pytest.param({"enable_prefix_caching": False}, id="swap-no-prefix-cache"),
    ],
)
def test_greedy_matches_transformers_under_forced_swap(
    tiny_model_dir, prompts, reference, engine_args  # noqa: F811
):
    llm = LLM(
        tiny_model_dir, dtype="float32", num_kv_blocks=20, preemption_mode="swap",
        num_swap_blocks=200, **engine_args,
    )
    got, _ = run_checked(llm.engine, prompts, GREEDY)
    stats = llm.get_stats()
    assert stats["swapped_out_blocks"] > 0 and stats["swapped_in_blocks"] > 0
    assert stats["num_requests_swapped"] == 0
    assert got == reference


def test_swap_with_shared_prefix_blocks_stays_exact(tiny_model_dir, prompts, reference):  # noqa: F811
    """Every request shares the longest prompt's blocks, so swapped victims keep shared ones
    in place; outputs still match each prompt's own reference."""
    llm = LLM(
        tiny_model_dir, dtype="float32", num_kv_blocks=24, preemption_mode="swap",
        num_swap_blocks=200, max_num_batched_tokens=48,
    )
    # Twice each prompt: the second copy hits the first's blocks (shared while both run).
    doubled = [p for p in prompts for _ in range(2)]
    got, _ = run_checked(llm.engine, doubled, GREEDY)
    assert got == [r for r in reference for _ in range(2)]
    assert llm.get_stats()["swapped_out_blocks"] > 0


def test_auto_mode_recomputes_small_victims_and_swaps_large(tiny_model_dir, prompts, reference):  # noqa: F811
    llm = LLM(
        tiny_model_dir, dtype="float32", num_kv_blocks=20, preemption_mode="auto",
        num_swap_blocks=200, swap_min_computed_tokens=100, max_num_batched_tokens=64,
    )
    got, _ = run_checked(llm.engine, prompts, GREEDY)
    assert got == reference
    assert llm.get_stats()["num_preemptions"] > 0


def test_host_tier_hits_reload_evicted_prefixes_exactly(tiny_model_dir, prompts, reference):  # noqa: F811
    # 24 device blocks hold a few prompts at a time; the tier keeps what the device evicts.
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=24, num_host_kv_blocks=128,
              max_num_batched_tokens=64)
    first, _ = run_checked(llm.engine, prompts, GREEDY)
    before = llm.get_stats()
    assert before["host_cache_stored"] > 0
    second_requests = [
        llm.engine.add_request(f"again{i}", p, GREEDY) for i, p in enumerate(prompts)
    ]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        llm.engine.scheduler.check_integrity()
    after = llm.get_stats()
    assert first == reference
    assert [r.output_token_ids for r in second_requests] == reference
    # Full prefix blocks came back, from one tier or the other, never computed.
    expected_hits = [((len(p) - 1) // 16) * 16 for p in prompts]
    assert [r.num_cached_tokens for r in second_requests] == expected_hits
    assert sum(r.num_host_cached_tokens for r in second_requests) > 0
    assert after["host_cache_hits"] > 0
    assert after["kv_transfer_bytes_to_device"] > 0
    # Preempted requests look the cache up again on resumption, so the counter may grow more.
    host_hit_tokens = after["prefix_cache_host_hits"] - before["prefix_cache_host_hits"]
    assert host_hit_tokens >= sum(r.num_host_cached_tokens for r in second_requests)


def test_swap_and_host_tier_together(tiny_model_dir, prompts, reference):  # noqa: F811
    llm = LLM(
        tiny_model_dir, dtype="float32", num_kv_blocks=20, preemption_mode="swap",
        num_swap_blocks=64, num_host_kv_blocks=32, max_num_batched_tokens=32,
    )
    got, _ = run_checked(llm.engine, prompts + prompts[::-1], GREEDY)
    assert got == reference + reference[::-1]
    assert len(got[0]) == NEW_TOKENS
