"""The routing question, answered by Redis in one round trip (a Lua script).

Input: the router's block size hint and the prompt's chained block hashes. Output, for every
*live* engine (its registry hash exists; see kvfleet/redis_schema.py): how many leading
blocks of the prompt its current epoch's block set holds, the size of that set, and every
registry field (address, epoch, block_size, load...).

Invariants:
- One EVALSHA per lookup (redis-py's Script falls back to EVAL once after a Redis restart).
- Only the current epoch's block set counts: a restarted engine's stale blocks never match.
- An engine whose block_size differs from the hint gets 0 matched blocks (its hashes would
  differ); the caller sees its block size in the result and re-asks with the right one.
- Matching stops at the first missing block, in chunks, so a long prompt that misses early
  costs little and no Lua `unpack` limit is hit.
- Any Redis failure (refused, timeout, script error) raises `PrefixIndexUnavailable`
  quickly (short socket timeouts, no client-side retries) so the caller can fall back to
  load-only routing. Redis Cluster is not supported: the script touches keys it derives.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvfleet import redis_schema

logger = logging.getLogger(__name__)

ENGINE_KEY_PREFIX = redis_schema.engine_key("")
# blocks_key(id, epoch) == BLOCKS_KEY_PREFIX + id + ":" + epoch (checked by the tests).
BLOCKS_KEY_PREFIX = redis_schema.blocks_key("", "").removesuffix(":")
# Blocks checked per SMISMEMBER call inside the script.
MATCH_CHUNK = 64

# KEYS[1] = engines set; ARGV = engine key prefix, blocks key prefix, block size, chunk, hashes...
LOOKUP_SCRIPT = """
local engine_prefix, blocks_prefix = ARGV[1], ARGV[2]
local block_size, chunk = tonumber(ARGV[3]), tonumber(ARGV[4])
local first_hash, last_hash = 5, #ARGV
local result = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local fields = redis.call('HGETALL', engine_prefix .. id)
  if #fields > 0 then
    local info = {}
    for i = 1, #fields, 2 do info[fields[i]] = fields[i + 1] end
    local matched, cached = 0, 0
    if info['epoch'] then
      local bkey = blocks_prefix .. id .. ':' .. info['epoch']
      cached = redis.call('SCARD', bkey)
      if cached > 0 and tonumber(info['block_size']) == block_size then
        local i = first_hash
        while i <= last_hash do
          local j = math.min(i + chunk - 1, last_hash)
          local hits = redis.call('SMISMEMBER', bkey, unpack(ARGV, i, j))
          local all = true
          for k = 1, #hits do
            if hits[k] == 1 then matched = matched + 1 else all = false; break end
          end
          if not all then break end
          i = j + 1
        end
      end
    end
    table.insert(result, {id, matched, cached, fields})
  end
end
return result
"""


class PrefixIndexUnavailable(Exception):
    """Redis could not answer; route by load alone."""


@dataclass(frozen=True)
class EngineRecord:
    """One live engine as Redis sees it, plus its match for the prompt."""

    engine_id: str
    matched_blocks: int
    num_cached_blocks: int
    fields: Mapping[str, str]

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

    def int_field(self, name: str) -> int:
        return _int(self.fields.get(name)) or 0

    def float_field(self, name: str) -> float:
        try:
            return float(self.fields.get(name, 0.0))
        except ValueError:
            return 0.0


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value is not None else None
    except ValueError:
        return None


class PrefixIndex:
    """Async reader of the engines' registry and block index."""

    def __init__(self, redis_url: str, timeout_s: float = 0.5) -> None:
        self._client = redis.asyncio.Redis.from_url(
            redis_url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # Fail fast: the fallback (load-only routing) beats waiting for Redis.
            retry=Retry(NoBackoff(), 0),
        )
        self._script = self._client.register_script(LOOKUP_SCRIPT)

    async def lookup(self, block_size: int, hashes: Sequence[bytes]) -> list[EngineRecord]:
        """Every live engine with its leading-block match; PrefixIndexUnavailable on failure."""
        args: list[Any] = [ENGINE_KEY_PREFIX, BLOCKS_KEY_PREFIX, block_size, MATCH_CHUNK]
        args.extend(hashes)
        try:
            raw = await self._script(keys=[redis_schema.ENGINES_SET], args=args)
        except (redis.exceptions.RedisError, OSError) as e:
            raise PrefixIndexUnavailable(f"redis: {e}") from e
        return [_record(item) for item in raw]

    async def close(self) -> None:
        await self._client.aclose()


def _record(item: Sequence[Any]) -> EngineRecord:
    engine_id, matched, cached, flat = item
    fields = {
        _text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)
    }
    return EngineRecord(_text(engine_id), int(matched), int(cached), fields)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
