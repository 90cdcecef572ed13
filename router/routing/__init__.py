"""Which engine gets a request: the prefix index, the ranking policies, one decision.

- `prefix_index`: one Redis round trip: every live engine's cached leading blocks and load.
- `ranking`: pure ranking functions (`--policy prefix | round_robin | least_load`).
- `decision`: index + pool + ranking -> engines ranked best-first (load-only without Redis).
- `lora_engines`, `lora_placement`: which engines serve an adapter; loading it on one more.

Invariant: no routing state lives only in a router replica; all of it is rebuilt from Redis
or engine RPCs, so replicas agree and restart freely.
"""
