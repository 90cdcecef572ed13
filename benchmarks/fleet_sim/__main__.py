"""`python -m benchmarks.fleet_sim`: run every policy on one seeded workload, print a table.

Starts a throwaway Redis (kvfleet.redis_server) unless `--redis-url` is given; flushes it
before each policy (engines re-register, routers start fresh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.fleet_sim import calibration, metrics, report
from benchmarks.fleet_sim.simulator import POLICIES, FleetSim, SimConfig, patient_index
from benchmarks.fleet_sim.workload import SHAPES, Workload, WorkloadConfig
from kvfleet.redis_server import RedisServer
from router.routing.prefix_index import PrefixIndexConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fleet_sim", description=__doc__)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--tenants", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--shape", choices=SHAPES, default="llmd")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--replicas", type=int, default=2, help="router replicas deciding (1-4)")
    p.add_argument("--duration-s", type=float, default=1800.0, help="simulated seconds")
    p.add_argument("--warmup-s", type=float, default=None, help="default: 10%% of duration")
    p.add_argument("--sessions-per-s", type=float, default=None,
                   help="session arrival rate (default: 0.1 per engine)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=0,
                   help="sessions at most (0: all that arrive); prefix_repetition needs it")
    p.add_argument("--system-tokens", type=int, default=6000)
    p.add_argument("--user-tokens", type=int, default=120)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--think-s", type=float, default=5.0)
    p.add_argument("--kv-blocks", type=int, default=None, help="override the calibration's")
    cal = p.add_mutually_exclusive_group()
    cal.add_argument("--calibration", type=Path, default=None,
                     help="a calibration JSON (default: the cached one, measured if absent)")
    cal.add_argument("--default-calibration", action="store_true",
                     help="the small built-in calibration (tests)")
    p.add_argument("--full-scan-max-engines", type=int,
                   default=PrefixIndexConfig.full_scan_max_engines,
                   help="routers read every engine up to this fleet size, candidates beyond")
    p.add_argument("--candidate-window", type=int, default=PrefixIndexConfig.candidate_window,
                   help="least loaded engines a candidate lookup adds")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--progress-s", type=float, default=300.0,
                   help="a progress line every this many simulated seconds (0: none)")
    return p.parse_args(argv)


def load_calibration(args: argparse.Namespace) -> calibration.Calibration:
    if args.default_calibration:
        cal = calibration.DEFAULT
    elif args.calibration is not None:
        cal = calibration.load(args.calibration)
    else:
        cal = calibration.load_or_measure()
    if args.kv_blocks:
        cal = calibration.Calibration.from_json({**cal.to_json(), "kv_blocks": args.kv_blocks})
    return cal


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    rate = args.sessions_per_s if args.sessions_per_s else 0.1 * args.engines
    return WorkloadConfig(
        shape=args.shape, tenants=args.tenants, turns=args.turns,
        system_tokens=args.system_tokens, user_tokens=args.user_tokens,
        output_tokens=args.output_tokens, sessions_per_s=rate, think_s=args.think_s,
        duration_s=args.duration_s, seed=args.seed, max_sessions=args.num_prompts,
    )


async def run_policy(policy: str, args: argparse.Namespace, cal: calibration.Calibration,
                     wl: WorkloadConfig, redis_url: str) -> dict[str, float]:
    redis.Redis.from_url(redis_url).flushall()
    started = time.perf_counter()
    index = patient_index(full_scan_max_engines=args.full_scan_max_engines,
                          candidate_window=args.candidate_window)
    config = SimConfig(policy, args.engines, args.replicas, progress_every_s=args.progress_s,
                       index=index)
    sim = FleetSim(config, cal, Workload(wl), redis_url)
    run = await sim.run()
    warmup = args.warmup_s if args.warmup_s is not None else 0.1 * wl.duration_s
    row = metrics.summarize(run, warmup, cal.block_size)
    row["wall_s"] = time.perf_counter() - started
    row["redis_used_memory_bytes"] = float(redis.Redis.from_url(redis_url).info("memory")[
        "used_memory"])
    return row


async def main_async(args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    cal = load_calibration(args)
    wl = workload_config(args)
    print(f"calibration: {cal.source}; kv_blocks={cal.kv_blocks}", file=sys.stderr)
    rows: dict[str, dict[str, float]] = {}
    for policy in args.policies.split(","):
        rows[policy] = await run_policy(policy, args, cal, wl, redis_url)
        print(f"{policy}: done in {rows[policy]['wall_s']:.0f}s wall", file=sys.stderr)
    policies = report.with_oracle(rows)
    meta = {"config": {**vars(args), "json": str(args.json), "calibration": str(args.calibration)},
            "workload": wl.__dict__, "calibration": {k: v for k, v in cal.to_json().items()
                                                     if k != "samples"},
            "notes": "virtual-time simulation; decision times are wall-clock on a shared "
                     "machine (noisy), calibration likewise"}
    return report.document(policies, meta)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.redis_url:
        doc = asyncio.run(main_async(args, args.redis_url))
    else:
        with RedisServer() as server:
            doc = asyncio.run(main_async(args, server.url))
    print(report.table(doc["policies"]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
