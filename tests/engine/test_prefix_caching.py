"""Prefix caching seen through the engine: hit counts, salt isolation, the KV event hook."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheEvents
from engine.core.llm_engine import LLMEngine
from kvfleet.contracts.block_hash import hash_token_blocks

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def test_repeated_48_token_prompt_hits_32_tokens(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=32)
    prompt = {"prompt_token_ids": list(range(10, 58))}
    first = llm.generate(prompt, ONE, use_tqdm=False)[0]
    second = llm.generate(prompt, ONE, use_tqdm=False)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    stats = llm.get_stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (96, 32)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_cache_salt_isolates_tenants(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=32)
    ids = list(range(10, 58))
    llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, ONE, use_tqdm=False)
    other = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-b"}, ONE, use_tqdm=False)
    same = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, ONE, use_tqdm=False)
    unsalted = llm.generate({"prompt_token_ids": ids}, ONE, use_tqdm=False)
    assert other[0].num_cached_tokens == 0
    assert same[0].num_cached_tokens == 32
    assert unsalted[0].num_cached_tokens == 0


def test_kv_event_hook_reports_stored_and_removed_hashes(tiny_model_dir):
    events: list[KVCacheEvents] = []
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=4)
    engine = LLMEngine(config, kv_event_hook=events.append)
    first = list(range(10, 43))  # two full blocks + 1 token
    engine.add_request("a", first, ONE, cache_salt="t")
    while engine.has_unfinished_requests():
        engine.step()
    stored = [h for e in events for h in e.stored]
    assert stored == hash_token_blocks(first, 16, cache_salt="t")
    # A different 64-token prompt needs all four blocks, evicting both cached ones.
    events.clear()
    engine.add_request("b", list(range(100, 163)), ONE)
    while engine.has_unfinished_requests():
        engine.step()
    removed = [h for e in events for h in e.removed]
    assert sorted(removed) == sorted(stored)


def test_reset_prefix_cache_refused_while_in_use(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=16)
    engine = llm.engine
    engine.add_request("busy", list(range(10, 50)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert llm.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True
    again = llm.generate({"prompt_token_ids": list(range(10, 50))}, ONE, use_tqdm=False)
    assert again[0].num_cached_tokens == 0
