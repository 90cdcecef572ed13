"""Gemma 3 text against transformers, float32: local sliding layers (24-token window) with
their own RoPE base, a global layer with linear-scaled RoPE, (1 + w) q/k norms."""

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


@pytest.mark.parametrize("mode", ["one-batch", "chunked-16", "preemption", "torch-attention"])
def test_gemma3_greedy_matches_transformers(model_dir, reference, mode):
    check_mode(model_dir, *reference, mode)


def test_gemma3_logprobs_and_prefix_hits(model_dir, reference):
    check_logprobs_and_prefix_hits(model_dir, *reference)
