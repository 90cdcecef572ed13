"""Session fixtures shared by every test tier: model directories on disk.

Both are built once per session. `tiny_model_dir` is a seeded random Llama plus a trained
byte-level BPE tokenizer (builders in tests/fixtures/tiny_model.py); `smollm2_dir` converts
the default model's GGUF on first use and reuses the cached directory afterwards.
`redis_server` (a real redis-server per module) and `threaded_server` (in-process gRPC servers)
come from tests/fixtures/servers.py; fleets (real service processes) from
tests/fixtures/fleets.py, through the conftest of each directory that starts them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures.lora_adapters import ADAPTERS, build_adapter_dir
from tests.fixtures.servers import redis_server, threaded_server  # noqa: F401 - fixtures
from tests.fixtures.tiny_model import build_tiny_model_dir


def pytest_configure(config: pytest.Config) -> None:
    """Without a GPU, Triton runs interpreted (TRITON_INTERPRET=1). Triton fixes that mode
    when `triton.language` is first imported, and transformers imports triton whenever a model
    class is resolved, so the switch must come before any test runs, not in the Triton tier's
    own conftest (too late once another tier built a transformers model first)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_lora_dirs(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The three PEFT adapters of tests/fixtures/lora_adapters.py, by name."""
    root = tmp_path_factory.mktemp("tiny_loras")
    return {
        spec.name: build_adapter_dir(tiny_model_dir, spec, root / spec.name) for spec in ADAPTERS
    }


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from engine.models.default_model import prepare_default_model

    return prepare_default_model()
