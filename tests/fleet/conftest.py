"""Fleet tests: the shared fleet fixtures of tests/fixtures/fleets.py.

Each module gets one module-scoped `fleet` (override `fleet_options` to say how it differs);
`client` (gRPC router client), `openai_client` and `redis_client` talk to it.
"""

from tests.fixtures.fleets import (  # noqa: F401 - fixtures
    client,
    fleet,
    fleet_options,
    openai_client,
    redis_client,
    start_fleet,
)
