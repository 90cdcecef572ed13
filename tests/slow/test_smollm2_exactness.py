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


PREAMBLE = (
    "You are a careful assistant. Answer in one short sentence, plainly, without lists, "
    "without repeating the question, and without any preface. If a question has a number "
    "for an answer, give the number and its unit. If you do not know, say so. Keep to the "
    "facts that most encyclopedias agree on, and do not speculate about anything else.\n"
)


def test_smollm2_greedy_matches_transformers_when_decodes_share_a_prefix(smollm2_dir):
    """A long common preamble is cached by a first request; the eight prompts after it hit
    it and decode together, attending the shared blocks as one group."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer(PREAMBLE + p).input_ids for p in ["Hello", *PROMPTS]]
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    expected = []
    for ids in prompts:
        tensor = torch.tensor([ids])
        out = model.generate(tensor, attention_mask=torch.ones_like(tensor),
                             max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        expected.append(out[0, len(ids):].tolist())
    llm = LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert min(o.num_cached_tokens for o in rest) >= 64  # the preamble's blocks were shared
    assert [o.outputs[0].token_ids for o in first + rest] == expected
