"""The Redis key layout shared by engines (writers) and routers (readers).

Redis holds only rebuildable state; everything expires unless an engine keeps it alive.

- `kvfleet:engines` — SET of engine ids that have ever registered. Members may be stale: an
  engine is live only while its registry hash exists.
- `kvfleet:engine:{engine_id}` — HASH, TTL `REGISTRY_TTL_S`, refreshed by the engine's heartbeat
  and on every load update. Fields: address (host:port), epoch, block_size, model,
  max_model_len, num_running, num_waiting, kv_cache_usage, kv_blocks_free, kv_blocks_total,
  updated_at (unix seconds, float).
- `kvfleet:blocks:{engine_id}:{epoch}` — SET of block hashes (raw 16-byte digests from
  `engine.block_hash`) that the engine holds in its prefix cache in that epoch. TTL
  `BLOCKS_TTL_S`, refreshed with the heartbeat. A restarted engine takes a new epoch and deletes
  every `kvfleet:blocks:{engine_id}:*` key of its old epochs before registering.

Engines write each step's KV events (stored / removed hashes) as one pipelined SADD/SREM.
Routers answer "how many leading blocks does each live engine hold" in one round trip
(a Lua script reading every live engine's hash and running SMISMEMBER on its blocks set).

This module must stay free of redis/torch imports: it only names things.
"""

from __future__ import annotations

PREFIX = "kvfleet"
ENGINES_SET = f"{PREFIX}:engines"
REGISTRY_TTL_S = 5
HEARTBEAT_INTERVAL_S = 1.0
BLOCKS_TTL_S = 30


def engine_key(engine_id: str) -> str:
    return f"{PREFIX}:engine:{engine_id}"


def blocks_key(engine_id: str, epoch: str) -> str:
    return f"{PREFIX}:blocks:{engine_id}:{epoch}"


def blocks_key_pattern(engine_id: str) -> str:
    """Matches the block sets of every epoch of one engine (for clean-up on restart)."""
    return f"{PREFIX}:blocks:{engine_id}:*"
