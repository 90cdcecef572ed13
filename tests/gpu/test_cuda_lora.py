"""Multi-LoRA on a CUDA GPU (run by `make gpu-check`; skipped where there is none): three
adapters and the base model in one batch on CUDA, float32, through the Triton SGMV kernels
compiled for the GPU, give transformers + peft's greedy tokens, token for token."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine import LLM
from tests.engine.test_lora_exactness import (
    ADAPTERS,
    MODELS,
    _generate,
    expected,
    lora_requests,
    run_mixed,
)
from tests.fixtures.lora_adapters import peft_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    rng = random.Random(4321)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 40, 70)]


def test_cuda_three_adapters_and_base_in_one_batch(tiny_model_dir, tiny_lora_dirs, prompts):
    reference = {spec.name: _generate(peft_model(tiny_model_dir, spec), prompts)
                 for spec in ADAPTERS}
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference[None] = _generate(base, prompts)
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", enable_lora=True,
              max_loras=3, num_kv_blocks=256)
    assert llm.engine.runner.kv_caches[0].is_cuda and llm.engine.lora is not None
    got = run_mixed(llm.engine, prompts, lora_requests(tiny_lora_dirs), max_loras=3)
    assert got == expected(reference, prompts)
    assert set(MODELS) == {m for m, _ in got}
