"""The Redis key layout shared by engines (writers) and routers (readers).

Redis holds only rebuildable state; everything expires unless an engine keeps it alive.

- `kvfleet:engines` — SET of registered engine ids. An engine is live only while its
  registry hash exists and its heartbeat is fresh. Members whose hash has expired (a crashed
  engine) are removed by the routers' lookup script the first time it meets them, so the set
  only holds engines that registered within the last `REGISTRY_TTL_S` seconds (plus gone
  ones no router has looked up since) and a lookup's cost follows the live fleet, not every
  id that ever registered. An engine re-adds its id on every (re)registration.
- `kvfleet:engine:{engine_id}` — HASH, TTL `REGISTRY_TTL_S`, refreshed by the engine's heartbeat
  and on every load update. Fields: address (host:port), epoch, block_size, model,
  max_model_len, num_running, num_waiting, kv_cache_usage, kv_blocks_free, kv_blocks_total,
  max_num_seqs, max_loras (0: LoRA disabled), role (prefill, decode or both: what routers
  send it under prefill/decode disaggregation, docs/disaggregation.md; absent means both),
  lora_adapters (JSON list of the LoRA adapter names it serves; their parent is `model`),
  lora_paths (JSON object: each of those names -> the adapter directory it was loaded from),
  updated_at (unix seconds, float: the engine's clock at its last write).
- `kvfleet:blocks:{engine_id}:{epoch}` — SET of block hashes (raw 16-byte digests from
  `kvfleet.contracts.block_hash`) that the engine holds in its prefix cache in that epoch. TTL
  `BLOCKS_TTL_S`, refreshed with the heartbeat. A restarted engine takes a new epoch and deletes
  every `kvfleet:blocks:{engine_id}:*` key of its old epochs before registering.
- `kvfleet:host_blocks:{engine_id}:{epoch}` — SET of the block hashes the engine holds in the
  host tier of its prefix cache (`--kv-offloading-size`), same TTL and clean-up. A hash may be
  in both sets (reloaded to the device, still on the host); routers count a block as a device
  hit when it is in the first set, else as a host hit (worth less: it must be copied back).
- `kvfleet:pending:{engine_id}:{epoch}` — ZSET written by *routers*: block hashes of prompts a
  router just sent to that engine, which the engine has not published yet (it is still
  queueing or prefilling them). Score: when the entry stops counting, in Redis' clock (`TIME`,
  unix seconds). A router adds the blocks the engine lacks right after choosing it (ZADD GT:
  an entry's expiry only moves later), drops them again when the engine refused the request
  before accepting it, and trims expired entries on each write; the key itself expires once
  its longest entry has (`PENDING_MAX_TTL_S` at most). Routers count a prompt block as matched
  on an engine when it is in its device set, else its host set, else has a pending entry whose
  score is still ahead of `TIME`. Engines never read or write it; a restarted engine's new
  epoch starts with no pending entries.

- `kvfleet:holders:{hash}` — SET of the engine ids holding that block hash in their device
  prefix cache (any epoch; the raw 16-byte digest is the key's tail): the inverted index. An
  engine SADDs/SREMs its id in the same transaction as its own block set, and on a resync
  removes its id from every hash of its old sets it no longer holds. A member is only a
  *candidate*: routers confirm it against the engine's live registry and current-epoch set, so
  a crashed engine's leftover entries cost a lookup, never a wrong match (the lookup removes
  a dead engine's id from the keys it meets). No TTL: a live engine may hold a block for hours.
- `kvfleet:host_holders:{hash}` — the same for the host tier.
- `kvfleet:pending_holders:{hash}` — ZSET engine id -> expiry (Redis' clock), written by
  routers with a pending claim on the claim's first block, so an engine with only pending
  entries of a prompt is found as a candidate too. The key expires with its longest entry.
- `kvfleet:load` — ZSET engine id -> seconds of queued work (`load_score`: queued prefill
  tokens at the engine's prefill rate plus one decode step of its decoding requests),
  written on every flush. Routers of a large fleet read a window of the least loaded
  engines from it instead of every engine's registry (router/routing/prefix_index.py).

Liveness, as routers judge it: the hash exists, and `updated_at` is at most the router's
`--engine-stale-after` bound (default `DEFAULT_STALE_AFTER_S`, a few heartbeats) older than
Redis' own clock (`TIME`), so every router replica judges by the same clock. An engine whose
heartbeat stopped while its hash has not expired yet (a hung process) is skipped, not removed:
it comes back with its next heartbeat. The bound must exceed the clock skew between engines
and Redis (NTP keeps it to milliseconds) and stay below `REGISTRY_TTL_S` to matter.

Load fields the routers' cost model reads (`router.routing.ttft_cost`), published with the
load on every flush, absent from engines that predate them (routers then use defaults):
queued_prefill_tokens (prompt tokens still to compute in waiting and running requests, a
prefix shared by several of them counted once, cached blocks not at all), num_decoding
(running requests past their prompt), prefill_tokens_per_s and decode_s_per_seq (EWMAs the
engine measures from its own steps; 0: nothing measured yet).

Engines write each step's KV events (stored / removed hashes) as one pipelined SADD/SREM.
Routers answer "how many leading blocks does each live engine hold" in one round trip
(a Lua script running SMISMEMBER on each engine's blocks set, in chunks of 1, 4, 16, then 64
blocks, and answering one NUL-joined string per engine; see router/routing/prefix_index.py).
In a fleet of at most `FULL_SCAN_MAX_ENGINES` engines the script reads every live engine;
beyond it only the candidates: the holders of the prompt's first block (device, host,
pending) and a window of the least loaded engines, so a decision's cost follows the prompt
and the holders, not the fleet.

Sizes and costs: docs/fleet-simulator.md (benchmarks/fleet_sim/decision_cost.py measures
them).

This module must stay free of redis/torch imports: it only names things.
"""

from __future__ import annotations

PREFIX = "kvfleet"
ENGINES_SET = f"{PREFIX}:engines"
REGISTRY_TTL_S = 5
HEARTBEAT_INTERVAL_S = 1.0
BLOCKS_TTL_S = 30
# Heartbeat age beyond which routers stop choosing an engine (router flag --engine-stale-after).
DEFAULT_STALE_AFTER_S = 3 * HEARTBEAT_INTERVAL_S


# Engine roles (the registry's `role` field).
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_BOTH = "both"
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH)


# Bounds on how long a router's pending entry counts (router.routing.pending).
PENDING_MAX_TTL_S = 30


# Fleets up to this size are read whole by every lookup (exact, cheap); larger ones by candidates.
FULL_SCAN_MAX_ENGINES = 16
LOAD_ZSET = f"{PREFIX}:load"


def holders_key(block_hash: bytes) -> bytes:
    """The inverted index's key of one device block hash (binary: the raw digest)."""
    return f"{PREFIX}:holders:".encode() + block_hash


def host_holders_key(block_hash: bytes) -> bytes:
    return f"{PREFIX}:host_holders:".encode() + block_hash


def pending_holders_key(block_hash: bytes) -> bytes:
    return f"{PREFIX}:pending_holders:".encode() + block_hash


def engine_key(engine_id: str) -> str:
    return f"{PREFIX}:engine:{engine_id}"


def blocks_key(engine_id: str, epoch: str) -> str:
    return f"{PREFIX}:blocks:{engine_id}:{epoch}"


def blocks_key_pattern(engine_id: str) -> str:
    """Matches the block sets of every epoch of one engine (for clean-up on restart)."""
    return f"{PREFIX}:blocks:{engine_id}:*"


def host_blocks_key(engine_id: str, epoch: str) -> str:
    return f"{PREFIX}:host_blocks:{engine_id}:{epoch}"


def host_blocks_key_pattern(engine_id: str) -> str:
    """Matches the host-tier block sets of every epoch of one engine."""
    return f"{PREFIX}:host_blocks:{engine_id}:*"


def pending_key(engine_id: str, epoch: str) -> str:
    return f"{PREFIX}:pending:{engine_id}:{epoch}"
