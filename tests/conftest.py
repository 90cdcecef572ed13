"""Session fixtures shared by every test tier: model directories on disk.

Both are built once per session. `tiny_model_dir` is a seeded random Llama plus a trained
byte-level BPE tokenizer (builders in tests/fixtures/tiny_model.py); `smollm2_dir` converts
the default model's GGUF on first use and reuses the cached directory afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_model import build_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from engine.default_model import prepare_default_model

    return prepare_default_model()
