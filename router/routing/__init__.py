"""Which engine gets a request: the prefix index, the ranking policies, one decision.

- `prefix_index`: one Redis round trip: every live engine's cached (or pending) leading
  blocks and load; writing and dropping pending entries.
- `engine_view`, `ttft_cost`: what a decision knows of an engine; the prefix policy's
  estimated time to first token.
- `ranking`: pure ranking functions (`--policy prefix | round_robin | least_load`).
- `pending`: marking a sent prompt's blocks pending on its engine, in the background.
- `decision`: index + pool + ranking -> engines ranked best-first (load-only without Redis).
- `lora_engines`, `lora_placement`: which engines serve an adapter; loading it on one more.

Invariant: no routing state lives only in a router replica; all of it is rebuilt from Redis
or engine RPCs, so replicas agree and restart freely.
"""
