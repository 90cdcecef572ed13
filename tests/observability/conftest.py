"""Observability tests that need a fleet take the shared one of tests/fixtures/fleets.py; those
that trace, the OTLP receiver of tests/fixtures/otlp.py."""

from tests.fixtures.fleets import client, fleet, fleet_options  # noqa: F401 - fixtures
from tests.fixtures.otlp import receiver  # noqa: F401 - a fixture
