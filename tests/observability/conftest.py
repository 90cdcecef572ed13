"""Observability tests that need a fleet take the shared one of tests/fixtures/fleets.py."""

from tests.fixtures.fleets import client, fleet, fleet_options  # noqa: F401 - fixtures
