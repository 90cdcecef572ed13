"""A tiny-model fleet shared by the fault scenarios of one module (starting one costs seconds):
the shared `fleet` fixture (tests/fixtures/fleets.py) with the fault fleet's options."""

from __future__ import annotations

import pytest

from kvfleet.fleet import DEFAULT_START_TIMEOUT_S
from tests.faults.chaos import FAULT_CONTEXT, FAULT_FLEET
from tests.fixtures.fleets import FleetOptions, fleet  # noqa: F401 - the shared fixture


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {**FAULT_FLEET, "context": FAULT_CONTEXT, "start_timeout_s": DEFAULT_START_TIMEOUT_S}
