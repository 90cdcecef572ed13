"""A tiny-model fleet shared by the fault scenarios of one module (starting one costs seconds)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.fleet import Fleet
from tests.faults.chaos import fault_fleet_config, long_context_copy


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model_dir = long_context_copy(tiny_model_dir, tmp_path_factory.mktemp("fault-model") / "m")
    config = fault_fleet_config(model_dir, tmp_path_factory.mktemp("fault-fleet"))
    with Fleet(config) as running:
        yield running
