"""Gemma 2 (and Qwen3-MoE) through the Triton kernels (interpreted on CPU, compiled on a GPU):
the unified kernel's sliding window and logit soft-cap give transformers' greedy tokens in
float32, with chunked prefill crossing the window and on the decode-graph path (eager on CPU).

Two layers (one sliding with a 16-token window, one global), both capped; prompts run past
the window. Launch counters prove the attention ran in the kernel (no PyTorch fallback).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.family_models import build_family_dir
from tests.fixtures.greedy import random_prompts, transformers_greedy
from tests.kernels_triton.test_engine_triton import (
    HAS_CUDA,
    NEW_TOKENS,
    run_checked,
    triton_llm,
)

PROMPT_LENGTHS = [1, 12, 29, 40]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_dir(
        tmp_path_factory.mktemp("gemma2_triton"), "gemma2", num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )


@pytest.fixture(scope="module")
def prompts(gemma_dir: Path) -> list[list[int]]:
    return random_prompts(gemma_dir, PROMPT_LENGTHS, seed=7)


@pytest.fixture(scope="module")
def reference(gemma_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(gemma_dir, prompts, NEW_TOKENS)


def test_gemma2_triton_chunked_prefill_crosses_the_window(gemma_dir, prompts, reference):
    llm = triton_llm(gemma_dir, max_num_batched_tokens=16)
    assert llm.engine.kv.sliding is not None  # the sliding layer reads its own block tables
    assert run_checked(llm.engine, prompts) == reference


def test_gemma2_triton_decode_graph_path(gemma_dir, prompts, reference):
    # As on CUDA with graphs, where the engine keeps one block table (no sliding-window KV).
    llm = triton_llm(gemma_dir, disable_hybrid_kv_cache_manager=True)
    runner = llm.engine.runner
    runner.enable_decode_graphs((1, 2, 8), -(-llm.engine.max_model_len // 16), capture=HAS_CUDA)
    assert run_checked(llm.engine, prompts) == reference
    assert runner.decode_graphs is not None and set(runner.decode_graphs.runs) == {8}


def test_qwen3_moe_triton_chunked_prefill(tmp_path_factory):
    """The Llama-layout families through the kernel: q/k norm and MoE layers (Qwen3-MoE's
    path covers Qwen3's and Mixtral's; Phi-3 differs from Llama only in loading)."""
    model_dir = build_family_dir(tmp_path_factory.mktemp("qwen3_moe_triton"), "qwen3_moe",
                                 num_hidden_layers=2)
    prompts = random_prompts(model_dir, PROMPT_LENGTHS, seed=7)
    llm = triton_llm(model_dir, max_num_batched_tokens=16)
    assert run_checked(llm.engine, prompts) == transformers_greedy(model_dir, prompts,
                                                                   NEW_TOKENS)
