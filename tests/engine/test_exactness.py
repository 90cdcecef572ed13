"""Greedy output of the engine equals transformers' `generate`, token for token (float32).

The same prompts run in every scheduling mode: one mixed batch, a tiny token budget (chunked
prefill across many steps), a KV pool small enough to force preemption, and with prefix hits.
Block-pool integrity is checked after every step.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine

NEW_TOKENS = 32
PROMPT_LENGTHS = [1, 2, 7, 16, 17, 33, 64, 100, 150, 200]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    rng = random.Random(1234)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outputs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        generated = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(generated[0, len(ids) :].tolist())
    return outputs


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """Drive the engine step by step, checking block accounting after every step."""
    requests = [engine.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_integrity()
        steps += 1
        assert steps < 10_000, "engine made no progress"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [r.output_token_ids for r in requests], steps


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
