"""Speculative decoding counters: get_stats() and the engine's Prometheus metrics agree."""

from __future__ import annotations

from types import SimpleNamespace

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import KVCacheEvents
from engine.service.metrics import EngineMetrics
from tests.engine.test_spec_decode_exactness import NUM_DRAFTS, oracle_llm, run_checked


def test_metrics_mirror_get_stats(tiny_model_dir):
    prompts = [[5, 6, 7, 8] * 4, list(range(20, 45))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_model_dir, dtype="float32")
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # The oracle drafts the true continuation with mistakes at fixed positions.
    continuations = [o.outputs[0].token_ids for o in outs]
    llm = oracle_llm(tiny_model_dir, prompts, continuations, range(2))
    run_checked(llm.engine, prompts, params)
    stats = llm.get_stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_drafts"]
    per_pos = [stats[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(NUM_DRAFTS)]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # draft i + 1 is kept only after draft i

    metrics = EngineMetrics("m", llm.engine.max_model_len)
    metrics._engine = SimpleNamespace(engine=llm.engine)  # what attach() would hold
    metrics.on_step(KVCacheEvents([], []))
    metrics.on_step(KVCacheEvents([], []))  # counters move by deltas: no double counting
    registry = metrics.registry
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        sample = registry.get_sample_value(f"kvfleet:spec_decode_{name}_total", {"model_name": "m"})
        assert sample == stats[f"spec_decode_{name}"], name
    for position, count in enumerate(per_pos):
        sample = registry.get_sample_value(
            "kvfleet:spec_decode_num_accepted_tokens_per_pos_total",
            {"model_name": "m", "position": str(position)},
        )
        assert (sample or 0) == count
