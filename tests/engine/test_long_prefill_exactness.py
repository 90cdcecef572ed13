"""Greedy output equals transformers' `generate` with the long-prompt limit on
(engine.core.long_prefill_limit), on prompts that share prefixes, so the limit binds: followers
wait for their prefix, short prompts jump long ones (and, with short-prefill steps, keep long
ones out of their step), chunks are reordered.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.fixtures.greedy import random_prompts, run_checked, transformers_greedy

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    prefixes = random_prompts(tiny_model_dir, [40, 48, 33], seed=7)
    suffixes = random_prompts(tiny_model_dir, [3, 9, 20, 1, 5, 12, 2, 30, 7], seed=8)
    # Interleaved by prefix, as a router's requests arrive.
    return [prefixes[i % 3] + suffix for i, suffix in enumerate(suffixes)]


LIMIT = {"max_long_partial_prefills": 1}
SHORT_STEPS = {"short_prefill_steps": True}


@pytest.mark.parametrize("budget,policy", [
    pytest.param(2048, LIMIT, id="limit-whole"),
    pytest.param(32, LIMIT, id="limit-chunked"),
    pytest.param(2048, {**LIMIT, **SHORT_STEPS}, id="limit-short-steps"),
])
def test_greedy_matches_transformers_with_long_prefill_limit(tiny_model_dir, prompts, budget,
                                                            policy):
    llm = LLM(tiny_model_dir, dtype="float32", max_num_batched_tokens=budget,
              long_prefill_token_threshold=8, **policy)
    got, _ = run_checked(llm.engine, prompts, GREEDY)
    assert got == transformers_greedy(tiny_model_dir, prompts, NEW_TOKENS)
    # Every follower hit its prefix's full blocks (none was computed twice); the first of
    # each prefix hit nothing.
    lengths = [40, 48, 33]
    expected = sum(min(lengths[i % 3] // 16, (len(p) - 1) // 16) * 16
                   for i, p in enumerate(prompts) if i >= 3)
    assert llm.engine.kv.stats.hits == expected
