"""kvfleet: the layers every service shares, and the launcher on top of the services.

Shared layers (they import no service and nothing of the launcher; `tests/unit/
test_import_rules.py` holds that):
- `kvfleet.contracts`: what services agree on — block hashing, the Redis schema, sampling
  parameters and their proto form, n > 1 child requests, keep-alives, the error table.
- `kvfleet.text`: text handling — tokenizer loading, chat templates, incremental
  detokenization, stop strings and the output rules every output path applies.
- `kvfleet.runtime`: service plumbing — gRPC server and interceptors, options, logging,
  metrics, tracing, the event loop, the router credential.
- `kvfleet.v1`: the stubs generated from `proto/kvfleet/v1/*.proto` (`make proto`).

The launcher (imports the services): `cli` (the `kvfleet` command), `fleet` (a local fleet of
processes), `redis_server` (a throwaway redis-server), `run_logs` (where `up` keeps logs),
`router_client` (a small client of the router).

Invariant: importing this package (or any module in it) reads no environment variables and
starts nothing; services configure themselves from parsed arguments in their `main`.
"""
