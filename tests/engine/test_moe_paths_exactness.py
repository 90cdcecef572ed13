"""Mixtral and Qwen3-MoE against transformers, float32, with each CPU expert path forced.

The engine picks the MoE path per batch size by timing at start (engine.models.moe_select),
so the family tests run whichever won on the machine. Here the plan is pinned: the fused C++
kernel for every batch (decode rows, 16-token chunks, whole prompts) or the PyTorch path for
every batch; greedy tokens equal transformers' either way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import moe_select
from engine.models.moe import MoePlan
from tests.fixtures.family_exactness import check_mode, family_reference
from tests.fixtures.family_models import build_family_dir

pytestmark = pytest.mark.skipif(
    not moe_select.fused_available(torch.float32), reason="no C++ CPU kernels")

FAMILIES = ["mixtral", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model_dir = build_family_dir(tmp_path_factory.mktemp(request.param), request.param)
    return model_dir, family_reference(model_dir)


def pin_plan(monkeypatch: pytest.MonkeyPatch, plan: MoePlan) -> list[MoePlan]:
    """Replace the start-up timing by `plan`; returns the plans handed out (one per engine)."""
    given: list[MoePlan] = []

    def choose(*_args: object, **_kwargs: object) -> MoePlan:
        given.append(plan)
        return plan

    monkeypatch.setattr(moe_select, "choose_plan", choose)
    return given


@pytest.mark.parametrize("mode", ["one-batch", "chunked-16"])
def test_fused_kernel_greedy_matches_transformers(family, mode, monkeypatch):
    model_dir, (prompts, reference) = family
    given = pin_plan(monkeypatch, MoePlan.always())
    check_mode(Path(model_dir), prompts, reference, mode)
    assert given, "the engine did not configure its MoE layers"


def test_pytorch_path_greedy_matches_transformers(family, monkeypatch):
    model_dir, (prompts, reference) = family
    given = pin_plan(monkeypatch, MoePlan())
    check_mode(Path(model_dir), prompts, reference, "one-batch")
    assert given
