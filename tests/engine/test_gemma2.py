"""Gemma 2 against transformers, float32: sliding windows (16 tokens) alternating with global
layers, attention and final logit soft-capping, GeGLU, (1 + w) norms, tied embeddings.

Sliding-window KV is on (engine.core.kv_groups: 2 groups of 2 layers): the sliding layers drop
the blocks that left the window in every mode; once more with it off."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM
from tests.fixtures.family_exactness import (
    GREEDY,
    MODES,
    NEW_TOKENS,
    check_logprobs_and_prefix_hits,
    check_mode,
    family_reference,
)
from tests.fixtures.family_models import build_family_dir
from tests.fixtures.greedy import random_prompts, run_checked, transformers_greedy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_dir(tmp_path_factory.mktemp("gemma2"), "gemma2")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    return family_reference(model_dir)


# A block holds 2 of the 4 layers: 18 blocks are the KV memory of the other families' 9.
POOL = {"preemption": {"num_kv_blocks": 18}}


@pytest.mark.parametrize("mode", list(MODES))  # every mode: window, caps, tied head
def test_gemma2_greedy_matches_transformers(model_dir, reference, mode):
    llm = check_mode(model_dir, *reference, mode, **POOL.get(mode, {}))
    assert llm.engine.kv.sliding is not None
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    if mode == "one-batch":  # a KV handoff would move one block table: refused, naming the way
        with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager"):
            llm.engine.add_request("handoff", list(reference[0][-1]), GREEDY,
                                   prefill_only=True)


def test_gemma2_without_sliding_kv_matches_transformers(model_dir, reference):
    llm = check_mode(model_dir, *reference, "preemption", disable_hybrid_kv_cache_manager=True)
    assert llm.engine.kv.sliding is None


def test_gemma2_logprobs_and_prefix_hits(model_dir, reference):
    check_logprobs_and_prefix_hits(model_dir, *reference)


def test_gemma2_swap_preemption_keeps_every_block(model_dir, reference):
    """Swap moves one block table per request: sliding KV turns itself off, exactly."""
    llm = check_mode(model_dir, *reference, "preemption", preemption_mode="swap",
                     num_swap_blocks=64)
    assert llm.engine.kv.sliding is None and llm.engine.kv.swap is not None


def test_gemma2_long_prompt_fits_only_with_sliding_kv(model_dir):
    """300 prompt tokens against a 16-token window, in 32-token chunks: with sliding KV the
    request holds 20 full + at most 4 sliding blocks of 2 layers (24 blocks); every layer
    keeping every block would need 20 blocks of 4 layers, twice that memory."""
    prompts = random_prompts(model_dir, [300], seed=5)
    reference = transformers_greedy(model_dir, prompts, NEW_TOKENS)
    llm = LLM(str(model_dir), dtype="float32", linear_backend="dense", num_kv_blocks=24,
              max_num_batched_tokens=32)
    got, _ = run_checked(llm.engine, prompts, GREEDY)
    assert got == reference
    assert llm.get_stats()["num_preemptions"] == 0
    full = LLM(str(model_dir), dtype="float32", linear_backend="dense", num_kv_blocks=12,
               max_num_batched_tokens=32, disable_hybrid_kv_cache_manager=True)
    with pytest.raises(ValueError, match="needs 20 KV blocks but the cache has only 12"):
        full.engine.validate_request(prompts[0], GREEDY)


def test_gemma2_bfloat16_same_tokens_with_and_without_sliding_kv(model_dir, reference):
    """bfloat16 is not held to transformers, but freeing KV outside the window changes no
    arithmetic: the kernels see the same keys either way, so the tokens are identical."""
    prompts = reference[0]
    outputs = []
    for disable in (False, True):
        llm = LLM(str(model_dir), dtype="bfloat16", linear_backend="dense",
                  max_num_batched_tokens=32, disable_hybrid_kv_cache_manager=disable)
        assert (llm.engine.kv.sliding is None) is disable
        outputs.append(run_checked(llm.engine, prompts, GREEDY)[0])
    assert outputs[0] == outputs[1]


def test_gemma2_geglu_epilogue_matches_transformers(model_dir, reference):
    """The panel backend packs gate/up interleaved and runs GeGLU as the GEMM's epilogue."""
    llm = check_mode(model_dir, *reference, "one-batch", linear_backend="panel")
    proj = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    assert proj.interleaved and proj.gate_up_act == "gelu_tanh"
