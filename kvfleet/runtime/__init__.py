"""Service plumbing every kvfleet process shares.

- `grpc_server`: bind, health, reflection, graceful drain; `interceptors`: error mapping and
  drain tracking on every RPC.
- `options`: the server flags every service takes, parsed once into a frozen dataclass.
- `logs`, `metrics`, `tracing`: logging with request context, Prometheus, OpenTelemetry.
- `event_loop`: uvloop where installed, else asyncio's.
- `service_auth`: the router credential engines demand.

Invariant: imports no service; reads no environment at import time.
"""
