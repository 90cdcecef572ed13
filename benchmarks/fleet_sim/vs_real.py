"""`python -m benchmarks.fleet_sim.vs_real`: the simulator against the measured 2-engine fleet.

Runs the simulator on the real fleet benchmark's `prefix_repetition` case (benchmarks/
fleet_bench.py: `--num-prefixes` prefixes of `--prefix-len` tokens, `--suffix-len` own tokens,
`--output-len` out, `--num-prompts` prompts, Poisson at each rate or all at once for `inf`),
over as many simulated engines as the real fleet has, with the router's `prefix` policy and
one replica, from cold caches; then sets its hit rate and TTFT mean / median / P99 beside the
figures `fleet_bench.json` measured for `kvfleet-prefix` at the same rates, with the error of
each (simulated / measured - 1).

What is compared, and why it can differ: the simulated engine is the calibrated step model
(CPU time of one engine thread), the real one also waits for the other engine, the router,
the tokenizer service and the benchmark client on the same 2 cores, and its TTFT includes
HTTP, tokenization and gRPC; the hit rates count the same thing (prompt tokens served from
the prefix cache over prompt tokens) on the same prompt shape (random tokens, not the
benchmark's exact text).

Output: a table, and with `--json` `{"rates": {rate: {"sim": {...}, "real": {...},
"error": {...}}}, "calibration", "config"}`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import redis

from benchmarks.fleet_sim import calibration
from benchmarks.fleet_sim.metrics import quantile
from benchmarks.fleet_sim.simulator import FleetSim, RunRecord, SimConfig
from benchmarks.fleet_sim.workload import Workload, WorkloadConfig
from kvfleet.redis_server import RedisServer

SYSTEM = "kvfleet-prefix"
KEYS = ("hit_rate", "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fleet_sim.vs_real",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measured", type=Path, required=True,
                   help="a fleet_bench.json (benchmarks/fleet_bench.py) to compare with")
    p.add_argument("--rates", default="4,inf", help="request rates of its cases to simulate")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-blocks", type=int, default=None, help="override the calibration's")
    cal = p.add_mutually_exclusive_group()
    cal.add_argument("--calibration", type=Path, default=None,
                     help="a calibration JSON (default: the cached one, measured if absent); "
                          "measure it beside the real run for a fair comparison")
    cal.add_argument("--default-calibration", action="store_true",
                     help="the small built-in calibration (tests)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--redis-url", default=None)
    return p.parse_args(argv)


def workload(args: argparse.Namespace, rate: float) -> WorkloadConfig:
    return WorkloadConfig(shape="prefix_repetition", tenants=args.num_prefixes, turns=1,
                          system_tokens=args.prefix_len, user_tokens=args.suffix_len,
                          output_tokens=args.output_len, sessions_per_s=rate,
                          duration_s=3600.0, seed=args.seed, max_sessions=args.num_prompts)


def simulated(run: RunRecord) -> dict[str, float]:
    """The benchmark's figures from a simulated run (every request, no warm-up)."""
    ttfts = [(r.first_token_s - r.arrival_s) * 1000.0 for r in run.requests
             if r.first_token_s >= 0]
    prompt = sum(r.prompt_len for r in run.requests) or 1
    return {"hit_rate": sum(r.cached_tokens for r in run.requests) / prompt,
            "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else 0.0,
            "ttft_median_ms": statistics.median(ttfts) if ttfts else 0.0,
            "ttft_p99_ms": quantile(ttfts, 0.99),
            "completed": float(len(ttfts))}


def measured(doc: dict[str, Any], rate: str) -> dict[str, float]:
    case = doc["cases"].get(f"prefix_repetition@{rate}")
    if case is None or SYSTEM not in case["systems"]:
        raise SystemExit(f"--measured has no {SYSTEM} figures for prefix_repetition@{rate}")
    return {k: float(case["systems"][SYSTEM][k]) for k in KEYS}


async def simulate(args: argparse.Namespace, cal: calibration.Calibration, rate: float,
                   redis_url: str) -> dict[str, float]:
    redis.Redis.from_url(redis_url).flushall()
    sim = FleetSim(SimConfig("prefix", args.engines, replicas=1), cal,
                   Workload(workload(args, rate)), redis_url)
    return simulated(await sim.run())


def compare(args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    if args.default_calibration:
        cal = calibration.DEFAULT
    elif args.calibration is not None:
        cal = calibration.load(args.calibration)
    else:
        cal = calibration.load_or_measure()
    if args.kv_blocks:
        cal = calibration.Calibration.from_json({**cal.to_json(), "kv_blocks": args.kv_blocks})
    print(f"calibration: {cal.source}; kv_blocks={cal.kv_blocks}", file=sys.stderr)
    doc = json.loads(args.measured.read_text())
    rows: dict[str, Any] = {}
    for rate in args.rates.split(","):
        real = measured(doc, rate)
        sim = asyncio.run(simulate(args, cal, float(rate), redis_url))
        error = {k: sim[k] / real[k] - 1.0 if real[k] else 0.0 for k in KEYS}
        rows[rate] = {"sim": sim, "real": real, "error": error}
    return {"rates": rows, "config": {k: str(v) for k, v in vars(args).items()},
            "calibration": {k: v for k, v in cal.to_json().items() if k != "samples"},
            "measured_loadavg": [doc.get("loadavg_before"), doc.get("loadavg_after")]}


def table(result: dict[str, Any]) -> str:
    lines = [f"{'rate':>6}{'figure':>16}{'simulated':>12}{'measured':>12}{'error':>9}"]
    for rate, row in result["rates"].items():
        for k in KEYS:
            lines.append(f"{rate:>6}{k:>16}{row['sim'][k]:>12.3f}{row['real'][k]:>12.3f}"
                         f"{row['error'][k]:>+9.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(RedisServer()).url
        result = compare(args, url)
    print(table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
