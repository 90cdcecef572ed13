"""The routing question, answered by Redis in one round trip (a Lua script,
`router.routing.index_scripts`).

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
- The answer is one string (`ANSWER_SEP`-joined: the kind, then one string per live engine,
  `RECORD_SEP`-joined: id, matched, cached, host matched, pending matched, then every
  registry field and value), so a decision's parsing cost stays small at 128 engines
  (benchmarks/fleet_sim/decision_cost.py).
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
from kvfleet.contracts.block_hash import DIGEST_SIZE
from kvfleet.runtime.redis_access import NO_ACCESS, RedisAccess
from router.routing.index_scripts import (
    ANSWER_SEP,
    BLOCKS_KEY_PREFIX,
    ENGINE_KEY_PREFIX,
    HOLDERS_KEY_PREFIX,
    HOST_BLOCKS_KEY_PREFIX,
    HOST_HOLDERS_KEY_PREFIX,
    LOOKUP_SCRIPT,
    MARK_CHUNK,
    MARK_PENDING_SCRIPT,
    MATCH_CHUNK,
    PENDING_HOLDERS_KEY_PREFIX,
    PENDING_KEY_PREFIX,
    RECORD_SEP,
)

__all__ = [
    "BLOCKS_KEY_PREFIX",
    "ENGINE_KEY_PREFIX",
    "HOST_BLOCKS_KEY_PREFIX",
    "MATCH_CHUNK",
    "EngineRecord",
    "LookupAnswer",
    "PrefixIndex",
    "PrefixIndexBusy",
    "PrefixIndexConfig",
    "PrefixIndexUnavailable",
]

logger = logging.getLogger(__name__)


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
    # Least loaded engines a candidate lookup adds to the holders of the prompt's first block
    # (--routing-candidate-window).
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
            raise ValueError(f"--routing-candidate-window must be at least 1, got "
                             f"{self.candidate_window}")
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
    if value is None:
        return None
    # Engines publish counts as integer strings: int() parses them in a third of
    # int(float())'s time, and a decision parses every count of every candidate.
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return int(float(value))
    except (ValueError, OverflowError):  # "nan", "inf": not a count
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
                           PENDING_HOLDERS_KEY_PREFIX, DIGEST_SIZE, _joined(hashes)]
        raw = await self._run(self._script, [redis_schema.ENGINES_SET, redis_schema.LOAD_ZSET],
                              args)
        kind, *engines = _text(raw).split(ANSWER_SEP)
        return LookupAnswer([_record(item) for item in engines], kind == "full")

    async def mark_pending(
        self, engine_id: str, epoch: str, hashes: Sequence[bytes], ttl_s: float
    ) -> None:
        """Count `hashes` as held by the engine's epoch for `ttl_s` seconds (Redis' clock)."""
        if hashes:
            ttl_s = min(max(ttl_s, 0.001), redis_schema.PENDING_MAX_TTL_S)
            keys = [redis_schema.pending_key(engine_id, epoch),
                    redis_schema.pending_holders_key(hashes[0])]
            await self._run(self._mark_script, keys,
                            [ttl_s, MARK_CHUNK, engine_id, DIGEST_SIZE, _joined(hashes)])

    async def unmark_pending(self, engine_id: str, epoch: str, hashes: Sequence[bytes]) -> None:
        """Drop pending entries again (the engine refused the request they were for)."""
        if hashes:
            key = redis_schema.pending_key(engine_id, epoch)
            await self._run(self._unmark, [key], list(hashes))

    async def _unmark(self, keys: list[Any], args: list[Any]) -> Any:
        return await self._client.zrem(keys[0], *args)

    async def _run(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        """One call on a pooled connection; PrefixIndexBusy / PrefixIndexUnavailable."""
        if self._slots.locked():  # a free slot is taken at once: no timer to arm and cancel
            try:
                async with asyncio.timeout(self.config.pool_timeout_s):
                    await self._slots.acquire()
            except TimeoutError as e:
                raise PrefixIndexBusy(
                    f"all {self.config.max_connections} Redis connections stayed busy for "
                    f"{self.config.pool_timeout_s}s"
                ) from e
        else:
            await self._slots.acquire()
        try:
            return await script(keys=keys, args=args)
        except (redis.exceptions.RedisError, OSError) as e:
            raise PrefixIndexUnavailable(f"redis: {e}") from e
        finally:
            self._slots.release()

    async def close(self) -> None:
        await self._client.aclose()


def _record(item: str) -> EngineRecord:
    """One engine of the script's answer: NUL-separated id, counts, then field, value, ..."""
    parts = item.split(RECORD_SEP)
    engine_id, matched, cached, host_matched, pending_matched = parts[:5]
    flat = parts[5:]
    fields = dict(zip(flat[0::2], flat[1::2], strict=False))
    return EngineRecord(engine_id, int(matched), int(cached), fields, int(host_matched),
                        int(pending_matched))


def _joined(hashes: Sequence[bytes]) -> bytes:
    """The hashes as one argument of fixed-width entries (the scripts slice it)."""
    blob = b"".join(hashes)
    if len(blob) != DIGEST_SIZE * len(hashes):
        raise ValueError(f"hashes: every block hash must be {DIGEST_SIZE} bytes "
                         "(kvfleet.contracts.block_hash)")
    return blob


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
