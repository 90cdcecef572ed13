"""Slow tier: greedy output on SmolLM2-135M equals transformers' `generate`, token for token,
for 8 prompts of 32 new tokens in one batch (float32), again with chunked prefill, and with
n-gram speculative decoding (a trained model repeats itself, so drafts are verified and some
kept: the test checks that they were)."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi, my name is",
    "Today is a beautiful summer day",
    "Hello there",
    "The capital of France is",
    "def fibonacci(n):",
    "In a hole in the ground there lived",
    "The three primary colors are",
    "Water boils at a temperature of",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference(smollm2_dir) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
            do_sample=False, pad_token_id=tokenizer.eos_token_id,
        )
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 16}, {"speculative_config": NGRAM}],
    ids=["batch", "chunked", "ngram"],
)
def test_smollm2_greedy_matches_transformers(smollm2_dir, reference, engine_args):
    llm = LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=256, **engine_args)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    if "speculative_config" in engine_args:
        stats = llm.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
        assert stats["spec_decode_num_accepted_tokens"] > 0
