"""Writes what the simulated engines would publish into a real Redis.

Role: the simulator's stand-in for each engine's `engine.service.redis_publisher.RedisPublisher`
thread, using its own field and change functions (`registry_fields`, `apply_changes` with the
inverted index, `load_score`) and the
key layout of `kvfleet.contracts.redis_schema`, so the routers read exactly what real engines
would have written.

Invariants:
- `flush` is called before every routing decision with every engine that changed since the
  last one: a router sees each engine's state as of the decision's virtual instant (a real
  engine's lag of one step and one flush, a few ms, is not modelled).
- TTLs run on Redis' wall clock while the simulation runs on a virtual one: every engine's
  keys are refreshed at least every `HEARTBEAT_S` wall seconds (`updated_at` too), so no live
  engine ever expires or turns stale however fast or slow the simulation runs.
- One pipeline per flush (not one MULTI per engine): nothing else writes while it runs, so
  the state a decision reads is the same.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis

from benchmarks.fleet_sim.engine_model import SimEngine
from engine.service.engine_state import EngineLoad
from engine.service.prefill_work import StepRates
from engine.service.redis_publisher import (
    EngineRegistration,
    apply_changes,
    load_score,
    registry_fields,
)
from kvfleet.contracts import redis_schema

HEARTBEAT_S = 1.0
MODEL = "SmolLM2-135M-Instruct"


class SimPublisher:
    def __init__(self, redis_url: str, engines: Iterable[SimEngine], epoch: str) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self.engines = {e.engine_id: e for e in engines}
        self.epoch = epoch
        self.rates = {i: StepRates() for i in self.engines}
        self._regs = {i: EngineRegistration(i, f"{i}.sim:1", MODEL, e.cal.block_size,
                                            e.cal.max_model_len, e.cal.max_num_seqs)
                      for i, e in self.engines.items()}
        self._dirty: set[str] = set()
        self._heartbeat_at = 0.0

    def register_all(self) -> None:
        """Every engine's resync: fresh block sets, registry hash, engines set."""
        pipe = self._client.pipeline(transaction=False)
        for engine_id in self.engines:
            pipe.delete(redis_schema.blocks_key(engine_id, self.epoch))
            self._write(pipe, engine_id)
            pipe.sadd(redis_schema.ENGINES_SET, engine_id)
        pipe.execute()
        self._heartbeat_at = time.monotonic()

    def mark(self, engine_id: str) -> None:
        self._dirty.add(engine_id)

    def flush(self) -> None:
        heartbeat = time.monotonic() - self._heartbeat_at >= HEARTBEAT_S
        ids = list(self.engines) if heartbeat else sorted(self._dirty)
        if not ids:
            return
        pipe = self._client.pipeline(transaction=False)
        for engine_id in ids:
            self._write(pipe, engine_id)
        pipe.execute()
        self._dirty.clear()
        if heartbeat:
            self._heartbeat_at = time.monotonic()

    def _write(self, pipe: redis.client.Pipeline, engine_id: str) -> None:
        engine = self.engines[engine_id]
        key = redis_schema.blocks_key(engine_id, self.epoch)
        apply_changes(pipe, key, engine.cache.take_changes(), engine_id)
        pipe.expire(key, redis_schema.BLOCKS_TTL_S)
        load = self.load(engine)
        fields = registry_fields(self._regs[engine_id], self.epoch, load, time.time())
        ekey = redis_schema.engine_key(engine_id)
        pipe.hset(ekey, mapping=fields)
        pipe.expire(ekey, redis_schema.REGISTRY_TTL_S)
        pipe.zadd(redis_schema.LOAD_ZSET, {engine_id: load_score(load)})

    def load(self, engine: SimEngine) -> EngineLoad:
        cache, rates = engine.cache, self.rates[engine.engine_id]
        return EngineLoad(
            num_running=len(engine.running), num_waiting=len(engine.waiting),
            kv_cache_usage=cache.used / cache.capacity,
            kv_blocks_free=cache.capacity - cache.used, kv_blocks_total=cache.capacity,
            queued_prefill_tokens=engine.queued_prefill_tokens(),
            num_decoding=engine.num_decoding(),
            prefill_tokens_per_s=rates.prefill_tokens_per_s,
            decode_s_per_seq=rates.decode_s_per_seq,
        )

    def memory_bytes(self) -> int:
        return int(self._client.info("memory")["used_memory"])

    def close(self) -> None:
        self._client.close()
