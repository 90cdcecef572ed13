"""Gemma 3 text against transformers, float32: local sliding layers (24-token window) with
their own RoPE base, a global layer with linear-scaled RoPE, (1 + w) q/k norms.

Sliding-window KV is on (engine.core.kv_groups: the global layer's group and 3 sliding groups
of one layer each, so a block holds one layer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.family_exactness import (
    check_logprobs_and_prefix_hits,
    check_mode,
    family_reference,
)
from tests.fixtures.family_models import build_family_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_dir(tmp_path_factory.mktemp("gemma3_text"), "gemma3_text")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    return family_reference(model_dir)


@pytest.mark.parametrize("mode", ["one-batch", "chunked-16", "preemption", "torch-attention",
                                  "spec-ngram"])
def test_gemma3_greedy_matches_transformers(model_dir, reference, mode):
    # A block holds 1 of the 4 layers: 36 blocks are the KV memory of the other families' 9.
    pool = {"num_kv_blocks": 36} if mode == "preemption" else {}
    llm = check_mode(model_dir, *reference, mode, **pool)
    assert llm.engine.kv_groups is not None and llm.engine.kv_groups.num_groups == 4
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_gemma3_logprobs_and_prefix_hits(model_dir, reference):
    check_logprobs_and_prefix_hits(model_dir, *reference)


def test_gemma3_geglu_epilogue_matches_transformers(model_dir, reference):
    """The panel backend packs gate/up interleaved and runs GeGLU as the GEMM's epilogue."""
    llm = check_mode(model_dir, *reference, "one-batch", linear_backend="panel")
    proj = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    assert proj.interleaved and proj.gate_up_act == "gelu_tanh"
