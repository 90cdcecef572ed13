"""`python -m benchmarks.fleet_sim.decision_cost`: a routing decision's cost vs fleet size.

For each fleet size N (8 ... 128) on a fresh real Redis: N engines registered with the
registry fields real engines publish (`engine.service.redis_publisher.registry_fields`) and a
full KV cache's worth of block hashes each (`--blocks-per-engine`, default the calibration's
capacity), one of them holding most of the prompt's chain; then `--decisions` prefix
decisions of one router replica (`EngineSelector.decide`, as in the simulator) on a
`--prompt-tokens` prompt, timed by the wall clock (noisy on a shared machine: the p99 moves
by tens of percent between runs, and by far more when the machine is oversubscribed), and in
CPU time (the router process' and the Redis server's, per decision: what a decision costs
when it has the cores to itself). Also Redis' used_memory per engine and per cached block.

Output: a table, and JSON `{"sizes": {N: {...}}}` with `--json`; with `--profile PATH`, the
router's cProfile statistics over the decisions of every size (pstats format; read with
`python -m pstats PATH`) -- profiling slows the decisions, so its sizes' times are not figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.fleet_sim import calibration
from benchmarks.fleet_sim.metrics import quantile
from benchmarks.fleet_sim.publisher import MODEL
from engine.service.engine_state import EngineLoad
from engine.service.redis_publisher import (
    EngineRegistration,
    apply_changes,
    load_score,
    registry_fields,
)
from kvfleet.contracts import redis_schema
from kvfleet.contracts.block_hash import hash_token_blocks
from kvfleet.redis_server import RedisServer
from router.engines.pool import EnginePool
from router.routing.decision import EngineSelector, RoutingConfig
from router.routing.prefix_index import PrefixIndex

SIZES = (8, 16, 32, 64, 128)
TENANT = "tenant-0"


def populate(client: redis.Redis, engines: int, blocks: int, prompt_hashes: list[bytes],
             rng: random.Random) -> None:
    load = EngineLoad(num_running=4, num_waiting=1, kv_cache_usage=0.5, kv_blocks_free=blocks // 2,
                      kv_blocks_total=blocks, queued_prefill_tokens=500, num_decoding=4,
                      prefill_tokens_per_s=2000.0, decode_s_per_seq=0.005)
    for i in range(engines):
        engine_id, epoch = f"sim-{i:03d}", "e0"
        held = prompt_hashes[: len(prompt_hashes) * 4 // 5] if i == 0 else []
        # Other engines hold other prefixes (of the same tenant for some: a shared first
        # block would make them match one block, which is realistic and costs a chunk).
        held = held + [rng.randbytes(16) for _ in range(blocks - len(held))]
        pipe = client.pipeline(transaction=False)
        key = redis_schema.blocks_key(engine_id, epoch)
        apply_changes(pipe, key, dict.fromkeys(held, True), engine_id)
        reg = EngineRegistration(engine_id, f"{engine_id}.sim:1", MODEL, 16, 8192, 256)
        pipe.hset(redis_schema.engine_key(engine_id),
                  mapping=registry_fields(reg, epoch, load, time.time()))
        pipe.sadd(redis_schema.ENGINES_SET, engine_id)
        pipe.zadd(redis_schema.LOAD_ZSET, {engine_id: load_score(load)})
        pipe.execute()


def heartbeat(client: redis.Redis, engines: int) -> None:
    """Fresh `updated_at` for every engine, as their heartbeats would write (untimed)."""
    pipe = client.pipeline(transaction=False)
    for i in range(engines):
        pipe.hset(redis_schema.engine_key(f"sim-{i:03d}"), "updated_at", repr(time.time()))
    pipe.execute()


def redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def time_decisions(
    redis_url: str, prompt: list[int], n: int, engines: int,
    profile: cProfile.Profile | None = None,
) -> tuple[list[float], float, float]:
    """Wall seconds per decision; router and Redis CPU seconds per decision (means);
    `profile`: enabled around each timed decision."""
    index = PrefixIndex(redis_url)
    selector = EngineSelector(RoutingConfig(), index, EnginePool())
    client = redis.Redis.from_url(redis_url)
    beat = 0.0
    try:
        took: list[float] = []
        cpu = redis_cpu = 0.0
        for i in range(n + 20):  # the first 20: warm-up (script load, connection)
            if time.monotonic() - beat > redis_schema.HEARTBEAT_INTERVAL_S:
                heartbeat(client, engines)
                beat = time.monotonic()
            before = redis_cpu_s(client) if i >= 20 else 0.0
            if profile is not None and i >= 20:
                profile.enable()
            cpu_started, started = time.process_time(), time.perf_counter()
            decision = await selector.decide(prompt, TENANT)
            if profile is not None:
                profile.disable()
            if decision.claims is not None:
                # What sending it would do: the hold on its engine ends (its pending claim,
                # written in the background since the decision, stays as in the router).
                decision.claims.cancel()
            if i >= 20:
                took.append(time.perf_counter() - started)
                cpu += time.process_time() - cpu_started
                # INFO itself costs Redis a little CPU: counted, a slight overestimate.
                redis_cpu += redis_cpu_s(client) - before
        return took, cpu / n, redis_cpu / n
    finally:
        client.close()
        await index.close()


def measure_size(redis_url: str, engines: int, blocks: int, prompt: list[int],
                 decisions: int, profile: cProfile.Profile | None = None) -> dict[str, float]:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    base = int(client.info("memory")["used_memory"])
    hashes = hash_token_blocks(prompt[:-1], 16, cache_salt=TENANT)
    populate(client, engines, blocks, hashes, random.Random(engines))
    used = int(client.info("memory")["used_memory"]) - base
    took, cpu, redis_cpu = asyncio.run(time_decisions(redis_url, prompt, decisions, engines,
                                                      profile))
    ms = [s * 1000.0 for s in took]
    client.close()
    return {"engines": engines, "blocks_per_engine": blocks,
            "decision_p50_ms": quantile(ms, 0.5), "decision_p99_ms": quantile(ms, 0.99),
            "router_cpu_ms": cpu * 1000.0, "redis_cpu_ms": redis_cpu * 1000.0,
            "redis_bytes_per_engine": used / engines,
            "redis_bytes_per_block": used / (engines * blocks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fleet_sim.decision_cost",
                                description=__doc__)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--blocks-per-engine", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--decisions", type=int, default=500)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--profile", type=Path, default=None,
                   help="write the decisions' cProfile statistics here (pstats)")
    args = p.parse_args(argv)
    profile = cProfile.Profile() if args.profile is not None else None
    blocks = args.blocks_per_engine or calibration.load_or_measure().kv_blocks
    prompt = [random.Random(1).randrange(100, 40000) for _ in range(args.prompt_tokens)]
    rows: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(RedisServer()).url
        for n in (int(s) for s in args.sizes.split(",")):
            rows[str(n)] = measure_size(url, n, blocks, prompt, args.decisions, profile)
            print(json.dumps(rows[str(n)]), file=sys.stderr)
    print(f"{'engines':>8}{'p50_ms':>10}{'p99_ms':>10}{'router_cpu':>12}{'redis_cpu':>11}"
          f"{'B/engine':>12}{'B/block':>10}")
    for row in rows.values():
        print(f"{row['engines']:>8}{row['decision_p50_ms']:>10.2f}{row['decision_p99_ms']:>10.2f}"
              f"{row['router_cpu_ms']:>12.2f}{row['redis_cpu_ms']:>11.2f}"
              f"{row['redis_bytes_per_engine']:>12.0f}{row['redis_bytes_per_block']:>10.1f}")
    if profile is not None:
        profile.dump_stats(args.profile)
    if args.json is not None:
        doc = {"sizes": rows, "prompt_tokens": args.prompt_tokens,
               "notes": f"wall-clock on a shared {os.cpu_count()}-core machine: noisy"}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
