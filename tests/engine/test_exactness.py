"""Greedy output of the engine equals transformers' `generate`, token for token (float32).

The same prompts run in every scheduling mode: one mixed batch, a tiny token budget (chunked
prefill across many steps), a KV pool small enough to force preemption, and with prefix hits.
Block-pool integrity is checked after every step.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.fixtures.greedy import random_prompts, run_checked, transformers_greedy

NEW_TOKENS = 32
PROMPT_LENGTHS = [1, 2, 7, 16, 17, 33, 64, 100, 150, 200]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    return random_prompts(tiny_model_dir, PROMPT_LENGTHS, seed=1234)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> list[list[int]]:
    return transformers_greedy(tiny_model_dir, prompts, NEW_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({}, id="one-batch"),
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-32"),
        pytest.param({"max_num_seqs": 3}, id="max-seqs-3"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
        pytest.param({"attention_backend": "torch"}, id="torch-attention"),
    ],
)
def test_greedy_matches_transformers(tiny_model_dir, prompts, reference, engine_args):
    llm = LLM(tiny_model_dir, dtype="float32", **engine_args)
    got, _ = run_checked(llm.engine, prompts, GREEDY)
    assert got == reference


def test_greedy_matches_transformers_under_preemption(tiny_model_dir, prompts, reference):
    # 232 tokens need 15 blocks; 20 blocks cannot hold all ten requests at once.
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=20, max_num_batched_tokens=64)
    got, _ = run_checked(llm.engine, prompts, GREEDY)
    assert llm.get_stats()["num_preemptions"] > 0
    assert got == reference


def test_greedy_matches_transformers_with_prefix_hits(tiny_model_dir, prompts, reference):
    llm = LLM(tiny_model_dir, dtype="float32")
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == reference
    assert [o.outputs[0].token_ids for o in second] == reference
    expected_hits = [((len(p) - 1) // 16) * 16 for p in prompts]
    assert [o.num_cached_tokens for o in second] == expected_hits
    assert sum(expected_hits) > 0


def test_generate_outputs_in_input_order_with_text(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32")
    outs = llm.generate(
        ["hello world", {"prompt": "the cat sat"}, {"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.prompt for o in outs] == ["hello world", "the cat sat", None]
    assert outs[2].prompt_token_ids == [5, 6, 7]
    tokenizer = llm.get_tokenizer()
    for out in outs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length"
        assert len(completion.token_ids) == 5
        assert completion.text == tokenizer.decode(completion.token_ids)
