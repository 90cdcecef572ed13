"""Qwen3 (per-head q/k RMSNorm before RoPE, no qkv bias) against transformers, float32."""

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
    return build_family_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    return family_reference(model_dir)


@pytest.mark.parametrize("mode", ["one-batch", "chunked-16", "preemption", "torch-attention"])
def test_qwen3_greedy_matches_transformers(model_dir, reference, mode):
    check_mode(model_dir, *reference, mode)


def test_qwen3_logprobs_and_prefix_hits(model_dir, reference):
    check_logprobs_and_prefix_hits(model_dir, *reference)
