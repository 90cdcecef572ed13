"""The routing question, answered by Redis in one round trip (a Lua script).

Input: the router's block size hint and the prompt's chained block hashes. Output, for every *live*
engine (its registry hash exists and its heartbeat is fresh; see kvfleet/contracts/redis_schema.py):
how many leading blocks of the prompt its current epoch's block set holds, the size of that set, and
every registry field (address, epoch, block_size, load...).

Which engines: all live ones while the engines set has at most `full_scan_max_engines` members
(or the prompt has no block, or the caller asks for a full answer). A larger fleet's lookup
reads only *candidates*, so its cost follows the prompt and its holders, not the fleet:
the engines the inverted index names for the prompt's first block (device holders, host
holders, unexpired pending holders: an engine without the first block matches nothing), plus
`candidate_window` live engines among the least loaded (`kvfleet:load`) -- a slice, chosen
by the caller's seed, of those within `WINDOW_REL` / `WINDOW_ABS_S` of the least loaded when
there are more of them, so new prefixes spread over an idle fleet; holders do not count
towards the window, dead or stale members are passed over. Every candidate is matched
exactly as in a full answer; the answer says which kind it is (`LookupAnswer.complete`).

Invariants:
- One EVALSHA per lookup (redis-py's Script falls back to EVAL once after a Redis restart).
- Only the current epoch's block set counts: a restarted engine's stale blocks never match.
- An engine whose block_size differs from the hint gets 0 matched blocks (its hashes would
  differ); the caller sees its block size in the result and re-asks with the right one.
- A prompt block counts as a device match when the engine's device set holds it, else as a
  host match when its host-tier set does (`matched_host_blocks`), else as a pending match
  when a router's pending entry for it on that engine has not expired by Redis' clock
  (`matched_pending_blocks`: a request carrying it was just sent there and the engine has not
  published it yet); matching stops at the first block in none, in chunks growing from one
  block to `MATCH_CHUNK`, so an engine lacking the first block costs one lookup, a long
  prompt that misses early costs little and no Lua `unpack` limit is hit.
- The answer is one string per live engine (`RECORD_SEP`-joined: id, matched, cached, host
  matched, pending matched, then every registry field and value), so a decision's parsing
  cost stays small at 128 engines (benchmarks/fleet_sim/decision_cost.py).
- Pending entries are written by `mark_pending` (one EVALSHA, issued after the decision, off
  the request's critical path; see router.routing.pending), with the engine as a pending
  holder of the claim's first block, and dropped by `unmark_pending` (the holder entry then
  only names a candidate until it expires).
- The registry cleans itself: the script SREMs from the engines set (and the load ZSET, and
  the first block's holder keys) every id it meets whose hash has expired. An engine whose
  `updated_at` is older than `stale_after_s` by Redis' clock is left out of the answer (but
  stays registered: its next heartbeat brings it back).
- Connections are a bounded, blocking pool (`max_connections`): a burst of decisions waits
  for a connection instead of failing. A lookup that waited `pool_timeout_s` without getting
  one raises `PrefixIndexBusy` (Redis is up, this router is busy); any Redis failure
  (refused, timeout, script error) raises `PrefixIndexUnavailable` quickly (short socket
  timeouts, no client-side retries). Either way the caller routes without the index.
- Redis Cluster is not supported: the script touches keys it derives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig

from kvfleet.contracts import redis_schema
from kvfleet.runtime.redis_access import NO_ACCESS, RedisAccess

logger = logging.getLogger(__name__)

ENGINE_KEY_PREFIX = redis_schema.engine_key("")
# blocks_key(id, epoch) == BLOCKS_KEY_PREFIX + id + ":" + epoch (checked by the tests).
BLOCKS_KEY_PREFIX = redis_schema.blocks_key("", "").removesuffix(":")
HOST_BLOCKS_KEY_PREFIX = redis_schema.host_blocks_key("", "").removesuffix(":")
PENDING_KEY_PREFIX = redis_schema.pending_key("", "").removesuffix(":")
# Blocks checked per SMISMEMBER call inside the script, at most: the first call checks one
# block, each next one 4x more (1, 4, 16, 64, 64...), so an engine that lacks the prompt's
# first block (most of a large fleet: the chain is salted per tenant) costs one lookup, not 64.
MATCH_CHUNK = 64
# Separates an engine's id, counts, field names and values in the script's answer: one string
# per engine parses in C (str.split); ~45 RESP elements per engine cost ~4 ms of pure-Python
# parsing per decision at 64 engines. No registry field holds a NUL (JSON escapes it).
RECORD_SEP = "\0"
# Pending entries per ZADD call inside the mark script (bounded Lua stacks).
MARK_CHUNK = 500
# Engines whose queued work (`kvfleet:load`) is within this of the least loaded one's count
# as about as idle when a large fleet's lookup picks its window of candidates (the same
# tolerance as the ranking's ties, router.routing.ttft_cost).
WINDOW_REL = 0.2
WINDOW_ABS_S = 0.01
HOLDERS_KEY_PREFIX = redis_schema.holders_key(b"")
HOST_HOLDERS_KEY_PREFIX = redis_schema.host_holders_key(b"")
PENDING_HOLDERS_KEY_PREFIX = redis_schema.pending_holders_key(b"")

# KEYS[1] = engines set, KEYS[2] = load ZSET; ARGV = engine key prefix, blocks key prefix,
# block size, chunk, max heartbeat age in seconds (0: no bound), host blocks key prefix,
# pending key prefix, full-scan fleet size, candidate window, window seed, holders key
# prefix, host holders key prefix, pending holders key prefix, hashes...
# The answer's first element says "full" (every live engine) or "candidates".
LOOKUP_SCRIPT = """
local engine_prefix, blocks_prefix = ARGV[1], ARGV[2]
local block_size, chunk = tonumber(ARGV[3]), tonumber(ARGV[4])
local max_age = tonumber(ARGV[5])
local host_prefix, pending_prefix = ARGV[6], ARGV[7]
local full_max, window, seed = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local holders_prefix, host_holders_prefix = ARGV[11], ARGV[12]
local pending_holders_prefix = ARGV[13]
local first_hash, last_hash = 14, #ARGV
local SEP = '\0'
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
local result, gone = {}, {}

local function match(id, info)
  local matched, host_matched, pending_matched, cached = 0, 0, 0, 0
  if not info['epoch'] then return matched, cached, host_matched, pending_matched end
  local suffix = id .. ':' .. info['epoch']
  local bkey, hkey = blocks_prefix .. suffix, host_prefix .. suffix
  local pkey = pending_prefix .. suffix
  cached = redis.call('SCARD', bkey)
  local host_cached = redis.call('SCARD', hkey)
  local pending = redis.call('ZCARD', pkey)
  if cached + host_cached + pending > 0 and tonumber(info['block_size']) == block_size then
    local i, done, step = first_hash, false, 1
    while i <= last_hash and not done do
      local j = math.min(i + step - 1, last_hash)
      step = math.min(step * 4, chunk)
      local hits, host_hits, expiry = {}, {}, {}
      if cached > 0 then hits = redis.call('SMISMEMBER', bkey, unpack(ARGV, i, j)) end
      if host_cached > 0 then
        host_hits = redis.call('SMISMEMBER', hkey, unpack(ARGV, i, j))
      end
      if pending > 0 then expiry = redis.call('ZMSCORE', pkey, unpack(ARGV, i, j)) end
      for k = 1, j - i + 1 do
        if hits[k] == 1 then matched = matched + 1
        elseif host_hits[k] == 1 then host_matched = host_matched + 1
        elseif expiry[k] and tonumber(expiry[k]) > now then
          pending_matched = pending_matched + 1
        else done = true; break end
      end
      i = j + 1
    end
  end
  return matched, cached, host_matched, pending_matched
end

local function probe(id)
  local fields = redis.call('HGETALL', engine_prefix .. id)
  if #fields == 0 then table.insert(gone, id); return false end
  local info = {}
  for i = 1, #fields, 2 do info[fields[i]] = fields[i + 1] end
  local updated = tonumber(info['updated_at'])
  if max_age > 0 and updated ~= nil and now - updated > max_age then return false end
  local matched, cached, host_matched, pending_matched = match(id, info)
  table.insert(result, table.concat({id, matched, cached, host_matched, pending_matched,
                                     table.concat(fields, SEP)}, SEP))
  return true
end

local function append(ids, more)
  for _, id in ipairs(more) do table.insert(ids, id) end
end

-- The least loaded engines in the order the window takes them: those about as idle as the
-- least loaded one from an offset chosen by the seed (so new prefixes spread over an idle
-- fleet and every replica takes the same slice), then the rest of them, then the busier.
-- Up to 4 windows' worth: dead or stale members are passed over, not counted.
local function least_loaded()
  local want = window * 4
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if #first == 0 then return {} end
  local bound = tonumber(first[2]) * (1 + WINDOW_REL) + WINDOW_ABS_S
  local near = redis.call('ZCOUNT', KEYS[2], '-inf', bound)
  local offset = 0
  if near > window then offset = seed % near end
  local ids = redis.call('ZRANGE', KEYS[2], offset, math.min(near, offset + want) - 1)
  if offset > 0 then append(ids, redis.call('ZRANGE', KEYS[2], 0, offset - 1)) end
  if #ids < want then append(ids, redis.call('ZRANGE', KEYS[2], near, near + want - #ids - 1)) end
  return ids
end

local mode = 'full'
if last_hash < first_hash or redis.call('SCARD', KEYS[1]) <= full_max then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do probe(id) end
else
  mode = 'candidates'
  local h0 = ARGV[first_hash]
  local seen = {}
  local function consider(ids, limit)
    local added = 0
    for _, id in ipairs(ids) do
      if added >= limit then break end
      if not seen[id] then
        seen[id] = true
        if probe(id) then added = added + 1 end
      end
    end
  end
  local all = math.huge
  consider(redis.call('SMEMBERS', holders_prefix .. h0), all)
  consider(redis.call('SMEMBERS', host_holders_prefix .. h0), all)
  consider(redis.call('ZRANGEBYSCORE', pending_holders_prefix .. h0, now, '+inf'), all)
  consider(least_loaded(), window)
  for _, id in ipairs(gone) do
    redis.call('SREM', holders_prefix .. h0, id)
    redis.call('SREM', host_holders_prefix .. h0, id)
    redis.call('ZREM', pending_holders_prefix .. h0, id)
  end
end
for _, id in ipairs(gone) do
  redis.call('SREM', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
table.insert(result, 1, mode)
return result
""".replace("WINDOW_REL", repr(WINDOW_REL)).replace("WINDOW_ABS_S", repr(WINDOW_ABS_S))

# KEYS[1] = one engine's pending ZSET, KEYS[2] = the pending holders ZSET of the claim's first
# block; ARGV = seconds the entries count, chunk, engine id, hashes...
# Expiry scores come from Redis' clock so every router replica judges them alike.
MARK_PENDING_SCRIPT = """
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
local ttl, chunk = tonumber(ARGV[1]), tonumber(ARGV[2])
local expires = now + ttl
local keep = math.ceil(ttl) + 1
local i = 4
while i <= #ARGV do
  local args = {}
  for k = i, math.min(i + chunk - 1, #ARGV) do
    table.insert(args, expires)
    table.insert(args, ARGV[k])
  end
  redis.call('ZADD', KEYS[1], 'GT', unpack(args))
  i = i + chunk
end
for _, key in ipairs(KEYS) do
  if key == KEYS[2] then redis.call('ZADD', key, 'GT', expires, ARGV[3]) end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('TTL', key) < keep then redis.call('EXPIRE', key, keep) end
end
return 0
"""


class PrefixIndexUnavailable(Exception):
    """Redis could not answer; route by load alone."""


class PrefixIndexBusy(PrefixIndexUnavailable):
    """Every connection stayed in use for the pool timeout: Redis is up, this router is busy."""


@dataclass(frozen=True)
class PrefixIndexConfig:
    """How the router talks to Redis (router flags --redis-*, --engine-stale-after)."""

    # Beyond these Redis counts as unreachable. A refused connection fails at once; both
    # timeouts leave room for a busy router's event loop: a burst opening its pool's 64
    # connections at once on 2 cores took over 0.5 s for some of them (a CI run).
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 1.0
    # Connections this router opens at most; further lookups wait for a free one.
    max_connections: int = 64
    # How long a lookup waits for a free connection before routing goes without the index.
    pool_timeout_s: float = 2.0
    # Heartbeat age (seconds, Redis' clock) beyond which an engine is not live; 0: no bound.
    stale_after_s: float = redis_schema.DEFAULT_STALE_AFTER_S
    # A fleet of more live-registered engines is looked up by candidates (module docstring).
    full_scan_max_engines: int = redis_schema.FULL_SCAN_MAX_ENGINES
    # Least loaded engines a candidate lookup adds to the holders of the prompt's first block.
    candidate_window: int = 8

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("Redis timeouts must be positive")
        if self.max_connections < 1:
            raise ValueError(
                f"--redis-max-connections must be at least 1, got {self.max_connections}"
            )
        if self.pool_timeout_s <= 0:
            raise ValueError(
                f"--redis-pool-timeout must be positive, got {self.pool_timeout_s}"
            )
        if self.full_scan_max_engines < 0:
            raise ValueError(
                f"full_scan_max_engines must be >= 0, got {self.full_scan_max_engines}")
        if self.candidate_window < 1:
            raise ValueError(f"candidate_window must be at least 1, got {self.candidate_window}")
        if self.stale_after_s < 0:
            raise ValueError(
                f"--engine-stale-after must be >= 0 (0: off), got {self.stale_after_s}"
            )


@dataclass(frozen=True)
class EngineRecord:
    """One live engine as Redis (or its own GetLoad) reports it, plus its match for the prompt."""

    engine_id: str
    matched_blocks: int
    num_cached_blocks: int
    fields: Mapping[str, str]
    # Leading prompt blocks after the device matches that the engine's host tier holds.
    matched_host_blocks: int = 0
    # Blocks continuing that run which a router just sent the engine (pending entries).
    matched_pending_blocks: int = 0

    @property
    def address(self) -> str:
        return self.fields.get("address", "")

    @property
    def epoch(self) -> str:
        return self.fields.get("epoch", "")

    @property
    def block_size(self) -> int | None:
        return _int(self.fields.get("block_size"))

    @property
    def model(self) -> str:
        return self.fields.get("model", "")

    def int_field(self, name: str, default: int = 0) -> int:
        """The field as an int; `default` when it is missing or not a number."""
        value = _int(self.fields.get(name))
        return default if value is None else value

    def float_field(self, name: str) -> float:
        try:
            return float(self.fields.get(name, 0.0))
        except ValueError:
            return 0.0


@dataclass(frozen=True)
class LookupAnswer:
    """A lookup's engines; `complete`: every live engine, not a large fleet's candidates."""

    records: list[EngineRecord]
    complete: bool


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value is not None else None
    except ValueError:
        return None


# A burst of requests opens pool connections, and by default redis-py 8 spends each one's
# set-up on CLIENT SETINFO (after looking its own version up in the installed packages'
# metadata, ~1 ms of CPU) and CLIENT MAINT_NOTIFICATIONS (for Redis Enterprise), two round
# trips that Redis before 7.2 answers with errors. Neither is of use to the router.
LEAN_CONNECTIONS: dict[str, Any] = {
    "driver_info": None,
    "maint_notifications_config": MaintNotificationsConfig(enabled=False),
}


class PrefixIndex:
    """Async reader of the engines' registry and block index."""

    def __init__(
        self, redis_url: str, config: PrefixIndexConfig | None = None,
        access: RedisAccess = NO_ACCESS,
    ) -> None:
        self.config = config if config is not None else PrefixIndexConfig()
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            redis_url,
            max_connections=self.config.max_connections,
            timeout=self.config.pool_timeout_s,
            socket_timeout=self.config.read_timeout_s,
            socket_connect_timeout=self.config.connect_timeout_s,
            # Fail fast: the fallback (load-only routing) beats waiting for Redis.
            retry=Retry(NoBackoff(), 0),
            **LEAN_CONNECTIONS,
            **access.client_kwargs(redis_url),
        )
        self._client = redis.asyncio.Redis.from_pool(pool)
        self._script = self._client.register_script(LOOKUP_SCRIPT)
        self._mark_script = self._client.register_script(MARK_PENDING_SCRIPT)
        # One slot per connection, taken before the pool is asked: waiting for a slot is
        # "busy", anything the pool or Redis raises after it is "unavailable".
        self._slots = asyncio.Semaphore(self.config.max_connections)

    async def lookup(self, block_size: int, hashes: Sequence[bytes]) -> list[EngineRecord]:
        """The live engines (all, or a large fleet's candidates) with their leading-block match.

        PrefixIndexBusy when no connection freed up in time, PrefixIndexUnavailable when
        Redis failed.
        """
        return (await self.lookup_answer(block_size, hashes)).records

    async def lookup_answer(
        self, block_size: int, hashes: Sequence[bytes], *, seed: int = 0, full: bool = False
    ) -> LookupAnswer:
        """`lookup`, saying whether it read every live engine; `full` forces that.

        `seed` picks the slice of equally idle engines a candidate lookup adds (the same
        for every replica deciding on the same prompt).
        """
        full_max = 2**31 if full else self.config.full_scan_max_engines
        args: list[Any] = [ENGINE_KEY_PREFIX, BLOCKS_KEY_PREFIX, block_size, MATCH_CHUNK,
                           self.config.stale_after_s, HOST_BLOCKS_KEY_PREFIX, PENDING_KEY_PREFIX,
                           full_max, self.config.candidate_window, seed % 2**31,
                           HOLDERS_KEY_PREFIX, HOST_HOLDERS_KEY_PREFIX,
                           PENDING_HOLDERS_KEY_PREFIX]
        args.extend(hashes)
        raw = await self._run(self._script, [redis_schema.ENGINES_SET, redis_schema.LOAD_ZSET],
                              args)
        return LookupAnswer([_record(item) for item in raw[1:]], _text(raw[0]) == "full")

    async def mark_pending(
        self, engine_id: str, epoch: str, hashes: Sequence[bytes], ttl_s: float
    ) -> None:
        """Count `hashes` as held by the engine's epoch for `ttl_s` seconds (Redis' clock)."""
        if hashes:
            ttl_s = min(max(ttl_s, 0.001), redis_schema.PENDING_MAX_TTL_S)
            keys = [redis_schema.pending_key(engine_id, epoch),
                    redis_schema.pending_holders_key(hashes[0])]
            await self._run(self._mark_script, keys, [ttl_s, MARK_CHUNK, engine_id, *hashes])

    async def unmark_pending(self, engine_id: str, epoch: str, hashes: Sequence[bytes]) -> None:
        """Drop pending entries again (the engine refused the request they were for)."""
        if hashes:
            key = redis_schema.pending_key(engine_id, epoch)
            await self._run(self._unmark, [key], list(hashes))

    async def _unmark(self, keys: list[Any], args: list[Any]) -> Any:
        return await self._client.zrem(keys[0], *args)

    async def _run(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        """One call on a pooled connection; PrefixIndexBusy / PrefixIndexUnavailable."""
        try:
            async with asyncio.timeout(self.config.pool_timeout_s):
                await self._slots.acquire()
        except TimeoutError as e:
            raise PrefixIndexBusy(
                f"all {self.config.max_connections} Redis connections stayed busy for "
                f"{self.config.pool_timeout_s}s"
            ) from e
        try:
            return await script(keys=keys, args=args)
        except (redis.exceptions.RedisError, OSError) as e:
            raise PrefixIndexUnavailable(f"redis: {e}") from e
        finally:
            self._slots.release()

    async def close(self) -> None:
        await self._client.aclose()


def _record(item: bytes | str) -> EngineRecord:
    """One engine of the script's answer: NUL-separated id, counts, then field, value, ..."""
    parts = _text(item).split(RECORD_SEP)
    engine_id, matched, cached, host_matched, pending_matched = parts[:5]
    flat = parts[5:]
    fields = dict(zip(flat[0::2], flat[1::2], strict=False))
    return EngineRecord(engine_id, int(matched), int(cached), fields, int(host_matched),
                        int(pending_matched))


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
