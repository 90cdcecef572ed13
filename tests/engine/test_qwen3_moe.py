"""Qwen3-MoE against transformers, float32: q/k norm, 8 experts top-2 with norm_topk_prob,
layer 1 dense (mlp_only_layers)."""

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
    return build_family_dir(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    return family_reference(model_dir)


@pytest.mark.parametrize("mode", ["one-batch", "chunked-16", "preemption", "spec-ngram"])
def test_qwen3_moe_greedy_matches_transformers(model_dir, reference, mode):
    check_mode(model_dir, *reference, mode)


def test_qwen3_moe_logprobs_and_prefix_hits(model_dir, reference):
    check_logprobs_and_prefix_hits(model_dir, *reference)
