"""Contracts between services: what an engine, a router and a tokenizer service agree on.

- `block_hash`: the chained hash of a prompt's full blocks (engines publish them, routers
  look them up), salted by tenant.
- `redis_schema`: the Redis key layout engines write and routers read.
- `sampling_params`: `SamplingParams` (vLLM's fields and checks) and `sampling_proto`, its
  conversion from the gRPC message.
- `structured_outputs`: `StructuredOutputsParams` (vLLM's structured-output constraint),
  `structured_grammar` (it -> llguidance grammar, and the compile check router and engine
  share), `structured_proto` (its gRPC message, both ways).
- `parallel_sampling`: n > 1 as n child requests (ids, seeds), the same offline and online.
- `keepalive`: the keep-alive messages of Engine.Generate (slow vs. stalled).
- `errors`: the one table from an error kind to its gRPC status, HTTP status, OpenAI error
  type and the field it names.

Invariant: nothing here imports torch, a service package or the launcher, so every service
(and a router without torch) can import it (llguidance, imported on first use, needs no torch).
"""
