"""Gemma 2 against transformers, float32: sliding windows (16 tokens) alternating with global
layers, attention and final logit soft-capping, GeGLU, (1 + w) norms, tied embeddings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.family_exactness import (
    MODES,
    check_logprobs_and_prefix_hits,
    check_mode,
    family_reference,
)
from tests.fixtures.family_models import build_family_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_dir(tmp_path_factory.mktemp("gemma2"), "gemma2")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    return family_reference(model_dir)


@pytest.mark.parametrize("mode", list(MODES))  # every mode: window, caps, tied head
def test_gemma2_greedy_matches_transformers(model_dir, reference, mode):
    check_mode(model_dir, *reference, mode)


def test_gemma2_logprobs_and_prefix_hits(model_dir, reference):
    check_logprobs_and_prefix_hits(model_dir, *reference)
