"""kvfleet process plumbing shared by every service, plus the generated gRPC stubs.

Role: `kvfleet.v1` holds the stubs generated from `proto/kvfleet/v1/*.proto` (never edit them;
run `make proto`); `kvfleet.runtime.grpc_server` builds and drains a service's gRPC server;
`kvfleet.contracts.errors` is the one place exceptions become gRPC status codes.

Invariant: importing this package (or any module in it) reads no environment variables and
starts nothing; services configure themselves from parsed arguments in their `main`.
"""
