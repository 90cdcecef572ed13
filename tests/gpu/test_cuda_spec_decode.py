"""Speculative decoding on a CUDA GPU (run by `make gpu-check`; skipped where there is none):
greedy tokens with n-gram drafts and with the tiny model as its own draft equal transformers'
on the same GPU, in one batch; the self-draft keeps every verified draft. Verification steps
(1 + k query rows per request) run eagerly beside CUDA-graph decode steps."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.fixtures.greedy import random_prompts, run_checked, transformers_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    plain = random_prompts(tiny_model_dir, [5, 17, 40, 90], seed=4321)
    phrase = random_prompts(tiny_model_dir, [9], seed=7)[0]
    return [*plain, phrase * 5]  # repetitive: n-gram lookup finds matches


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> list[list[int]]:
    return transformers_greedy(tiny_model_dir, prompts, NEW_TOKENS, device="cuda")


def spec_stats(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.get_stats().items() if k.startswith("spec_decode")}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_cuda_speculation_keeps_greedy_tokens(tiny_model_dir, prompts, reference, method):
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": 4}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    else:
        spec["model"] = str(tiny_model_dir)
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", num_kv_blocks=256,
              speculative_config=spec)
    got, _ = run_checked(llm.engine, prompts, GREEDY)
    assert got == reference
    stats = spec_stats(llm)
    assert stats["spec_decode_num_draft_tokens"] > 0
    if method == "draft_model":
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
