"""A tiny-model fleet shared by the fault scenarios of one module (starting one costs seconds)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.fleet import Fleet
from tests.faults.chaos import fault_fleet_config


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    config = fault_fleet_config(tiny_model_dir, tmp_path_factory.mktemp("fault-fleet"))
    with Fleet(config) as running:
        yield running
