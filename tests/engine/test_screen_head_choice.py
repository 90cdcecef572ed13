"""The float32 LM head choice (every family: Qwen3 here for the Llama path, Gemma 2 with its
final logit cap): where start-up timing picked another float32 LM head than the panel
kernel, the screened head is measured against it, and where the screen won at some row count
the head moves to the panel kernel with the screen up to that count (greedy tokens unchanged);
where it never won, the timed choice stays. The measurement is replaced by fixed limits here
(no timings in unit tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.models import gemm_select, greedy_screen, llama
from engine.models.greedy_screen import screen_supported

pytestmark = pytest.mark.skipif(
    not screen_supported(torch.zeros(1, 1), "panel"),
    reason="needs the CPU kernels with AVX512-BF16",
)


@pytest.fixture(scope="module", params=["qwen3", "gemma2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.family_models import build_family_dir

    return build_family_dir(tmp_path_factory.mktemp(f"{request.param}_head"), request.param)


def _start(model_dir: Path, monkeypatch: pytest.MonkeyPatch, limit: int) -> Any:
    from engine import LLM

    # Timing "chose" oneDNN for the head and the panel kernel for the layers.
    monkeypatch.setattr(llama, "choose_backend", lambda *a, **k: gemm_select.GemmChoice(
        "panel", {}, head_backend="onednn"))
    measured: list[str] = []

    def measure(screen: object, full_argmax: Callable[..., object],
                repeats: int = greedy_screen.REPEATS) -> int:
        measured.append(type(screen).__name__)
        return limit

    monkeypatch.setattr(llama, "measure_rows_limit", measure)
    llm = LLM(str(model_dir), dtype="float32")
    assert measured == ["GreedyScreen"]
    return llm


def _greedy(llm: Any) -> list[list[int]]:
    from engine import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in ([5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 77])]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_screen_that_wins_moves_the_head_to_panel(model_dir, monkeypatch):
    llm = _start(model_dir, monkeypatch, limit=16)
    model = llm.engine.runner.model
    assert model._lm_head_backend == "panel"
    assert model._greedy_screen is not None and model._greedy_screen.max_rows == 16
    screened = _greedy(llm)
    monkeypatch.setattr(model, "greedy_tokens", lambda hidden: None)
    assert screened == _greedy(llm)  # the sampler over every (capped) logit of the panel head


def test_screen_that_never_wins_keeps_the_timed_head(model_dir, monkeypatch):
    model = _start(model_dir, monkeypatch, limit=0).engine.runner.model
    assert model._lm_head_backend == "onednn"
    assert model._greedy_screen is None
