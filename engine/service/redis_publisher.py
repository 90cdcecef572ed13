"""`RedisPublisher`: keeps one engine's registry entry, load and block index in Redis.

Role: the engine side of `kvfleet.contracts.redis_schema` (read it for the key layout). The engine
thread hands over each iteration's KV events through `on_step` (a dict update under a lock,
never I/O); a background thread turns them into Redis writes:

- start / (re)connect: a *resync*, one MULTI/EXEC: delete every block set of this engine id
  (old epochs and the current one), SADD the full current prefix cache, write the registry
  hash with its TTL, SADD the id to the engines set and its load score to the load ZSET.
  The inverted index (`redis_schema.holders_key`) follows: the id joins the holders of every
  cached hash and leaves those of the hashes its old sets held and the cache no longer does.
  The cache snapshot is taken on the engine thread (`call_in_engine_thread`), atomically
  with dropping the events it supersedes.
- every flush (as soon as events arrive, at most every `MIN_FLUSH_INTERVAL_S`, and at least
  every heartbeat): one MULTI/EXEC with EXISTS(registry), SADD/SREM of the net hash changes
  (in the block set and, for each changed hash, its holders set), EXPIRE of the block set,
  HSET of every registry field (static ones too, so the hash is always whole), EXPIRE of the
  registry and ZADD of the load score. EXISTS = 0 means Redis lost our keys (restarted,
  flushed, or our TTL lapsed): a resync follows at once.
- `deregister()` (graceful shutdown): stop the thread, then delete the registry hash and the
  block set, SREM the id from the engines set and its blocks' holders sets, ZREM its load.

Invariants:
- The engine thread never waits on Redis: `on_step` only records; writes happen elsewhere.
- Host-tier events go to a second set (`redis_schema.host_blocks_key`) by the same rules, in
  the same transactions; an engine without a host tier never writes it.
- Events are coalesced per hash, last state wins (stored then evicted before a flush = no
  write), so the set converges to exactly the engine's cached hashes.
- If Redis is unreachable the publisher drops pending events (a resync will rebuild the
  set), logs the first failure and then at most every `LOG_EVERY_S`, retries every heartbeat,
  and never raises into the engine.
- The id joins the engines set only on a resync. Routers prune ids whose registry hash has
  expired (kvfleet/contracts/redis_schema.py); an expired hash always leads to a resync
  (EXISTS = 0), which adds the id again, so a live engine is never left out for more than one flush.
- `updated_at` is written on every flush: routers treat an engine whose last one is older
  than their `--engine-stale-after` as not live (a hung engine stops heartbeating).
- Engine ids are restricted to `[A-Za-z0-9._-]` so the SCAN pattern of one engine can never
  match another engine's keys (no glob characters, no ':').
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.core.kv_cache_manager import KVCacheEvents
from engine.service.engine_state import EngineLoad
from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import BlockHash
from kvfleet.runtime.redis_access import NO_ACCESS, RedisAccess
from kvfleet.runtime.thread_names import name_os_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")
ENGINE_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Socket timeouts: a slow Redis costs the publisher thread this much, never the engine.
REDIS_TIMEOUT_S = 1.0
# How long a resync waits for the engine thread to snapshot its cache (a long step).
SNAPSHOT_TIMEOUT_S = 10.0
# Coalescing window: at most this many flushes per second while the engine steps.
MIN_FLUSH_INTERVAL_S = 0.005
LOG_EVERY_S = 30.0
# Hashes per SADD/SREM command (bounded argument lists).
CHUNK = 1000
# Prompt tokens per second assumed by the load score before the engine measured its rate.
DEFAULT_PREFILL_RATE = 1000.0


def validate_engine_id(engine_id: str) -> str:
    if not ENGINE_ID_PATTERN.fullmatch(engine_id):
        raise ValueError(
            f"engine id {engine_id!r} must be 1-128 characters of letters, digits, '.', '_', '-'"
        )
    return engine_id


@dataclass(frozen=True)
class EngineRegistration:
    """The registry fields that never change during an engine's life."""

    engine_id: str
    address: str
    model: str
    block_size: int
    max_model_len: int
    # Sequences one step runs at most, and adapters it mixes (0: LoRA disabled): routers
    # judge from them whether the engine is saturated and may be given an adapter.
    max_num_seqs: int = 0
    max_loras: int = 0
    # prefill, decode or both (kvfleet.contracts.redis_schema.ROLES).
    role: str = "both"


class EngineView(Protocol):
    """What the publisher needs from the engine (an `AsyncEngine` provides it)."""

    @property
    def load(self) -> EngineLoad: ...

    def call_in_engine_thread(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]: ...

    def cached_block_hashes(self) -> list[BlockHash]: ...

    def host_block_hashes(self) -> list[BlockHash]: ...


class RedisPublisher:
    """Publishes one engine to Redis from a background thread; see the module docstring."""

    def __init__(
        self,
        redis_url: str,
        registration: EngineRegistration,
        view: EngineView,
        *,
        epoch: str | None = None,
        heartbeat_s: float = redis_schema.HEARTBEAT_INTERVAL_S,
        access: RedisAccess = NO_ACCESS,
    ) -> None:
        validate_engine_id(registration.engine_id)
        self.registration = registration
        self.epoch = epoch or uuid.uuid4().hex
        self._view = view
        self._heartbeat_s = heartbeat_s
        self._engine_key = redis_schema.engine_key(registration.engine_id)
        self._blocks_key = redis_schema.blocks_key(registration.engine_id, self.epoch)
        self._host_blocks_key = redis_schema.host_blocks_key(registration.engine_id, self.epoch)
        self._client = redis.Redis.from_url(
            redis_url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),  # fail fast; the loop retries on its own schedule
            **access.client_kwargs(redis_url),
        )
        self._cond = threading.Condition()
        # hash -> True (cached) / False (evicted): the net change since the last flush, for
        # the device and the host tier.
        self._pending: dict[BlockHash, bool] = {}
        self._pending_host: dict[BlockHash, bool] = {}
        self._dirty = False
        self._stopping = False
        self._needs_resync = True
        self._not_before = 0.0
        self._heartbeat_due = 0.0
        self._thread: threading.Thread | None = None
        self._failures = 0
        self._last_log = -LOG_EVERY_S
        # Set once a host-tier hash was seen: from then on every flush refreshes that set's TTL.
        self._has_host_tier = False
        self.registered = threading.Event()  # set after every successful write, cleared on failure

    # -- engine thread ---------------------------------------------------------------------

    def on_step(self, events: KVCacheEvents) -> None:
        """Record one engine iteration (a `StepListener`): no I/O, never blocks on Redis."""
        with self._cond:
            if self._stopping:
                return
            for block_hash in events.stored:
                self._pending[block_hash] = True
            for block_hash in events.removed:
                self._pending[block_hash] = False
            for block_hash in events.stored_host:
                self._pending_host[block_hash] = True
            for block_hash in events.removed_host:
                self._pending_host[block_hash] = False
            self._dirty = True
            self._cond.notify()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(target=self._run, name="redis-publisher", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop publishing without touching Redis (keys then expire by their TTLs)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self._client.close()

    def deregister(self) -> bool:
        """Stop publishing and delete this engine's keys; False if Redis was unreachable."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        try:
            engine_id = self.registration.engine_id
            device: set[Any] = self._client.smembers(self._blocks_key)
            host: set[Any] = self._client.smembers(self._host_blocks_key)
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._engine_key, self._blocks_key, self._host_blocks_key)
            pipe.srem(redis_schema.ENGINES_SET, engine_id)
            pipe.zrem(redis_schema.LOAD_ZSET, engine_id)
            apply_holders(pipe, engine_id, dict.fromkeys(device, False))
            apply_holders(pipe, engine_id, dict.fromkeys(host, False), host=True)
            pipe.execute()
            logger.info("deregistered engine %s from Redis", self.registration.engine_id)
            return True
        except (redis.RedisError, OSError) as exc:
            logger.warning("could not deregister from Redis (keys will expire): %s", exc)
            return False
        finally:
            self._client.close()

    # -- publisher thread ------------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread()
        while True:
            pending = self._wait_for_work()
            if pending is None:
                return
            ok = self._sync(pending)
            now = time.monotonic()
            with self._cond:
                self._not_before = now + (MIN_FLUSH_INTERVAL_S if ok else self._heartbeat_s)
                self._heartbeat_due = now + self._heartbeat_s

    def _wait_for_work(self) -> _Pending | None:
        """Block until a flush is due; returns the pending changes, or None when stopping."""
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                due = self._dirty or now >= self._heartbeat_due
                if due and now >= self._not_before:
                    break
                wake_at = self._not_before if self._dirty else self._heartbeat_due
                self._cond.wait(max(wake_at, self._not_before) - now)
            if self._stopping:
                return None
            pending = _Pending(self._pending, self._pending_host)
            self._pending, self._pending_host, self._dirty = {}, {}, False
            return pending

    def _sync(self, pending: _Pending) -> bool:
        try:
            if not self._needs_resync and not self._flush(pending):
                logger.warning("engine %s vanished from Redis; re-registering",
                               self.registration.engine_id)
                self._needs_resync = True
            if self._needs_resync:
                num_blocks = self._resync()
                self._needs_resync = False
                self._on_registered(num_blocks)
        except Exception as exc:  # Redis down, timeouts, engine busy: never fatal
            self._on_failure(exc)
            return False
        self.registered.set()
        return True

    def _flush(self, pending: _Pending) -> bool:
        """One transaction with the net changes and the load; False if our registry was gone."""
        pipe = self._client.pipeline(transaction=True)
        pipe.exists(self._engine_key)
        engine_id = self.registration.engine_id
        apply_changes(pipe, self._blocks_key, pending.device, engine_id)
        pipe.expire(self._blocks_key, redis_schema.BLOCKS_TTL_S)
        self._has_host_tier = self._has_host_tier or bool(pending.host)
        if self._has_host_tier:
            apply_changes(pipe, self._host_blocks_key, pending.host, engine_id, host=True)
            pipe.expire(self._host_blocks_key, redis_schema.BLOCKS_TTL_S)
        load = self._view.load
        pipe.hset(self._engine_key, mapping=self._registry_fields(load))
        pipe.expire(self._engine_key, redis_schema.REGISTRY_TTL_S)
        pipe.zadd(redis_schema.LOAD_ZSET, {engine_id: load_score(load)})
        results = pipe.execute()
        return bool(results[0])

    def _resync(self) -> int:
        """Replace everything this engine id has in Redis with the current truth."""
        snapshot = self._view.call_in_engine_thread(self._capture_cache)
        hashes, host_hashes = snapshot.result(SNAPSHOT_TIMEOUT_S)
        self._has_host_tier = self._has_host_tier or bool(host_hashes)
        engine_id = self.registration.engine_id
        stale = [list(self._client.scan_iter(match=pattern, count=1000))
                 for pattern in (redis_schema.blocks_key_pattern(engine_id),
                                 redis_schema.host_blocks_key_pattern(engine_id))]
        # What the old sets held: those hashes leave the inverted index unless still cached.
        held = [set().union(*(self._client.smembers(k) for k in keys)) for keys in stale]
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._blocks_key, self._host_blocks_key, self._engine_key,
                    *stale[0], *stale[1])
        for chunk in _chunks(hashes):
            pipe.sadd(self._blocks_key, *chunk)
        pipe.expire(self._blocks_key, redis_schema.BLOCKS_TTL_S)
        for chunk in _chunks(host_hashes):
            pipe.sadd(self._host_blocks_key, *chunk)
        pipe.expire(self._host_blocks_key, redis_schema.BLOCKS_TTL_S)
        apply_holders(pipe, engine_id, _replacing(held[0], hashes))
        apply_holders(pipe, engine_id, _replacing(held[1], host_hashes), host=True)
        load = self._view.load
        pipe.hset(self._engine_key, mapping=self._registry_fields(load))
        pipe.expire(self._engine_key, redis_schema.REGISTRY_TTL_S)
        pipe.sadd(redis_schema.ENGINES_SET, engine_id)
        pipe.zadd(redis_schema.LOAD_ZSET, {engine_id: load_score(load)})
        pipe.execute()
        return len(hashes)

    def _capture_cache(self) -> tuple[list[BlockHash], list[BlockHash]]:
        # Engine thread: events recorded so far are part of this snapshot; later ones follow.
        with self._cond:
            self._pending.clear()
            self._pending_host.clear()
        return self._view.cached_block_hashes(), self._view.host_block_hashes()

    def _registry_fields(self, load: EngineLoad) -> dict[Any, str]:
        return registry_fields(self.registration, self.epoch, load, time.time())

    def _on_registered(self, num_blocks: int) -> None:
        if self._failures:
            logger.info("Redis reachable again after %d failed attempt(s)", self._failures)
        logger.info("registered engine %s (epoch %s) in Redis with %d cached block(s)",
                    self.registration.engine_id, self.epoch, num_blocks)
        self._failures = 0

    def _on_failure(self, exc: BaseException) -> None:
        self.registered.clear()
        with self._cond:
            self._pending.clear()  # the resync on reconnect re-publishes the whole cache
            self._pending_host.clear()
        self._needs_resync = True
        self._failures += 1
        now = time.monotonic()
        if self._failures == 1 or now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            expected = isinstance(exc, (redis.RedisError, OSError, TimeoutError))
            logger.warning(
                "Redis publish failed (%d attempt(s) so far; serving continues, retrying every "
                "%.1fs): %s", self._failures, self._heartbeat_s, exc, exc_info=not expected
            )


def registry_fields(
    reg: EngineRegistration, epoch: str, load: EngineLoad, updated_at: float
) -> dict[Any, str]:
    """Every field of the engine's registry hash (kvfleet/contracts/redis_schema.py); also
    what the fleet simulator (benchmarks/fleet_sim) publishes for its simulated engines."""
    return {
        "address": reg.address,
        "epoch": epoch,
        "block_size": str(reg.block_size),
        "model": reg.model,
        "max_model_len": str(reg.max_model_len),
        "max_num_seqs": str(reg.max_num_seqs),
        "max_loras": str(reg.max_loras),
        "role": reg.role,
        "num_running": str(load.num_running),
        "num_waiting": str(load.num_waiting),
        "kv_cache_usage": repr(load.kv_cache_usage),
        "kv_blocks_free": str(load.kv_blocks_free),
        "kv_blocks_total": str(load.kv_blocks_total),
        # The routers' cost model (router.routing.ttft_cost).
        "queued_prefill_tokens": str(load.queued_prefill_tokens),
        "num_decoding": str(load.num_decoding),
        "prefill_tokens_per_s": repr(load.prefill_tokens_per_s),
        "decode_s_per_seq": repr(load.decode_s_per_seq),
        "lora_adapters": json.dumps(list(load.lora_adapters)),
        "lora_paths": json.dumps(dict(zip(load.lora_adapters, load.lora_paths, strict=True))),
        "updated_at": repr(updated_at),
    }


@dataclass(frozen=True)
class _Pending:
    """Net changes since the last flush: hash -> cached (True) / evicted (False)."""

    device: dict[BlockHash, bool]
    host: dict[BlockHash, bool]


def apply_changes(
    pipe: Any, key: str, changes: dict[BlockHash, bool], engine_id: str, *, host: bool = False
) -> None:
    """SADD the hashes now cached, SREM the evicted ones (`changes`: hash -> cached), in the
    engine's set `key` and in each hash's holders set (the inverted index)."""
    added = [h for h, cached in changes.items() if cached]
    removed = [h for h, cached in changes.items() if not cached]
    for chunk in _chunks(added):
        pipe.sadd(key, *chunk)
    for chunk in _chunks(removed):
        pipe.srem(key, *chunk)
    apply_holders(pipe, engine_id, changes, host=host)


def apply_holders(
    pipe: Any, engine_id: str, changes: dict[BlockHash, bool], *, host: bool = False
) -> None:
    """The engine joins (True) or leaves (False) each hash's holders set: one command per
    hash, the price of a lookup that reads only the prompt's holders."""
    key_of = redis_schema.host_holders_key if host else redis_schema.holders_key
    for block_hash, cached in changes.items():
        if cached:
            pipe.sadd(key_of(block_hash), engine_id)
        else:
            pipe.srem(key_of(block_hash), engine_id)


def load_score(load: EngineLoad) -> float:
    """Seconds of work queued on the engine (`redis_schema.LOAD_ZSET`): its queued prompt
    tokens at its measured prefill rate plus one decode step of its decoding requests, and
    a millisecond per request so that, work being equal, the fewer requests rank first."""
    rate = load.prefill_tokens_per_s if load.prefill_tokens_per_s > 0 else DEFAULT_PREFILL_RATE
    step = load.decode_s_per_seq if load.decode_s_per_seq > 0 else 0.0
    requests = load.num_running + load.num_waiting
    return load.queued_prefill_tokens / rate + load.num_decoding * step + 0.001 * requests


def _replacing(old: set[Any], new: Sequence[BlockHash]) -> dict[BlockHash, bool]:
    """Changes turning the holders of `old` into those of `new`."""
    changes: dict[BlockHash, bool] = dict.fromkeys(old, False)
    changes.update(dict.fromkeys(new, True))
    return changes


def _chunks(items: Sequence[BlockHash]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), CHUNK):
        yield items[start : start + CHUNK]
