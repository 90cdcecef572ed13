"""Serving benchmark (`make bench-serve`): routing policies side by side on one local fleet.

Workload: `--tenants` (8) tenants, each with a system prompt of `--system-tokens` (512)
tokens; every request is a chat [that system prompt, a short user turn of ~`--user-tokens`],
tenant drawn uniformly, Poisson arrivals at `--rate` req/s, `--num-requests` per policy,
`--output-len` tokens each (greedy, EOS ignored, so every policy does the same decode work).
The default rate (8/s) is above what any policy sustains on 2 CPU cores, so throughput is
each policy's capacity and TTFT includes queueing; at a rate only round robin cannot
sustain, prefix's throughput is capped by the arrival rate and the ratio is smaller.

Set-up: one fleet (a real Redis, the tokenizer service, `--engines` engines with
`--num-kv-blocks` KV blocks and `--engine-threads` torch threads each) and one router per
policy (`prefix`, `round_robin`, `least_load`), run one after the other with the same
arrival times and user turns. Each policy has its own tenants (API keys), so none profits
from prefixes another policy left in the caches (leftovers are evictable, never pinned).
The KV cache (192 blocks of 16 tokens per engine) holds about 5 of the 8 tenants' ~34-block
prefixes when nothing runs, fewer under load: 4 tenants per engine fit, 8 do not, so
placement decides the hit rate, which is the point of prefix-aware routing.

Reported per policy: throughput (requests/s and output tokens/s over the makespan, first
arrival to last completion), TTFT p50/p99 (client side), prefix hit rate (cached prompt
tokens / prompt tokens, as the engines report them), requests per engine. Target: prefix
>= 1.5x round_robin throughput with a lower p99 TTFT. Results go to bench_results/serve.json.
Timings are noisy on a shared machine: the load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvfleet.fleet import Fleet, FleetConfig
from kvfleet.router_client import Completion, build_request, channel, generate
from kvfleet.text.tokenizer import Tokenizer
from kvfleet.v1 import common_pb2, router_pb2_grpc

POLICIES = ("prefix", "round_robin", "least_load")
TARGET_SPEEDUP = 1.5
WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
    "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
    "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "river",
    "mountain", "forest", "ocean", "desert", "valley", "island", "harbor", "castle", "garden",
)
Row = dict[str, Any]


@dataclass(frozen=True)
class Arrival:
    at_s: float
    tenant: int
    user_turn: str


def words_to_tokens(tokenizer: Tokenizer, rng: random.Random, head: str, num_tokens: int) -> str:
    """`head` plus random words, cut to about `num_tokens` tokens."""
    words = head.split()
    while len(tokenizer.encode(" ".join(words), False)) < num_tokens:
        words.extend(rng.choice(WORDS) for _ in range(16))
    while len(tokenizer.encode(" ".join(words), False)) > num_tokens:
        words.pop()
    return " ".join(words)


def system_prompts(tokenizer: Tokenizer, num_tenants: int, num_tokens: int) -> list[str]:
    rng = random.Random(7)
    return [
        words_to_tokens(tokenizer, rng, f"You are the assistant of tenant number {t}.",
                        num_tokens)
        for t in range(num_tenants)
    ]


def arrivals(args: argparse.Namespace, tokenizer: Tokenizer) -> list[Arrival]:
    """Poisson arrival times, tenants and user turns: the same for every policy."""
    rng = random.Random(args.seed)
    at, out = 0.0, []
    for i in range(args.num_requests):
        at += rng.expovariate(args.rate)
        turn = words_to_tokens(tokenizer, rng, f"Question {i}:", args.user_tokens)
        out.append(Arrival(at, rng.randrange(args.tenants), turn))
    return out


def api_key(policy: str, tenant: int) -> str:
    return f"key-{policy}-{tenant}"


def write_api_keys(path: Path, tenants: int) -> Path:
    names = [*POLICIES, "warmup"]
    keys = {f"{p}-tenant-{t}": [api_key(p, t)] for p in names for t in range(tenants)}
    path.write_text(json.dumps({"tenants": keys}))
    return path


async def run_policy(address: str, policy: str, schedule: Sequence[Arrival],
                     prompts: Sequence[str], output_len: int) -> tuple[list[Completion], float]:
    """Send the schedule through one router; (completions, makespan seconds)."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    async with channel(address) as chan:
        stub = router_pb2_grpc.RouterStub(chan)
        started = time.monotonic()

        async def one(arrival: Arrival) -> Completion:
            await asyncio.sleep(max(0.0, started + arrival.at_s - time.monotonic()))
            messages = [("system", prompts[arrival.tenant]), ("user", arrival.user_turn)]
            request = build_request(messages=messages, params=params)
            return await generate(stub, request, api_key=api_key(policy, arrival.tenant),
                                  timeout_s=1800)

        completions = await asyncio.gather(*(one(a) for a in schedule))
        return list(completions), time.monotonic() - started


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summarize(policy: str, schedule: Sequence[Arrival], completions: Sequence[Completion],
              makespan_s: float) -> Row:
    ttfts = [c.ttft_s for c in completions if c.ttft_s is not None]
    prompt_tokens = sum(c.usage.get("prompt_tokens", 0) for c in completions)
    cached = sum(c.num_cached_tokens for c in completions)
    return {
        "policy": policy,
        "requests": len(completions),
        "makespan_s": makespan_s,
        "req_per_s": len(completions) / makespan_s,
        "output_tok_per_s": sum(c.num_tokens for c in completions) / makespan_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": statistics.fmean(ttfts),
        "prefix_hit_rate": cached / max(1, prompt_tokens),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "per_engine": dict(sorted(Counter(c.engine_id for c in completions).items())),
        "tenant_engines": tenant_engines(schedule, completions),
        "requests_detail": [
            {"tenant": a.tenant, "at_s": round(a.at_s, 3), "engine": c.engine_id,
             "cached": c.num_cached_tokens, "prompt": c.usage.get("prompt_tokens", 0),
             "ttft_s": c.ttft_s, "latency_s": round(c.latency_s, 3)}
            for a, c in zip(schedule, completions, strict=True)
        ],
    }


def tenant_engines(schedule: Sequence[Arrival], completions: Sequence[Completion]
                   ) -> dict[str, dict[str, int]]:
    """Per tenant, how many of its requests each engine served (placement stickiness)."""
    placement: dict[str, Counter[str]] = {}
    for arrival, completion in zip(schedule, completions, strict=True):
        placement.setdefault(str(arrival.tenant), Counter())[completion.engine_id] += 1
    return {t: dict(sorted(c.items())) for t, c in sorted(placement.items())}


def print_table(rows: Sequence[Row]) -> None:
    header = (f"{'policy':<12} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9}"
              f" {'hit rate':>9}  per engine")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['policy']:<12} {r['req_per_s']:>7.2f} {r['output_tok_per_s']:>9.1f}"
              f" {r['ttft_p50_s']:>8.2f}s {r['ttft_p99_s']:>8.2f}s"
              f" {r['prefix_hit_rate']:>8.1%}  {r['per_engine']}")


def verdict(rows: Sequence[Row]) -> Row:
    by_policy = {r["policy"]: r for r in rows}
    prefix, rr = by_policy["prefix"], by_policy["round_robin"]
    speedup = prefix["req_per_s"] / rr["req_per_s"]
    met = speedup >= TARGET_SPEEDUP and prefix["ttft_p99_s"] < rr["ttft_p99_s"]
    return {"speedup_vs_round_robin": speedup, "target": TARGET_SPEEDUP, "met": met}


def start_fleet(args: argparse.Namespace, model_dir: Path, work: Path) -> Fleet:
    work.mkdir(parents=True, exist_ok=True)
    config = FleetConfig(
        model_dir=model_dir,
        num_engines=args.engines,
        policy=POLICIES[0],
        api_keys=write_api_keys(work / "keys.json", args.tenants),
        engine_args=("--num-kv-blocks", str(args.num_kv_blocks)),
        engine_threads=args.engine_threads,
        log_dir=work / "logs",
        log_level="WARNING",
    )
    fleet = Fleet(config).start()
    try:
        for policy in POLICIES[1:]:
            fleet.add_router(f"router-{policy}", policy)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def router_addresses(fleet: Fleet) -> dict[str, str]:
    addresses = {POLICIES[0]: fleet.router_address}
    for router in fleet.extra_routers:
        addresses[router.name.removeprefix("router-")] = router.address
    return addresses


async def warm_up(address: str, prompts: Sequence[str], engines: int) -> None:
    """A few untimed requests so first-call costs (allocations, caches) hit no policy."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async with channel(address) as chan:
        stub = router_pb2_grpc.RouterStub(chan)
        requests = [build_request(messages=[("system", prompts[0][:200]), ("user", f"hi {i}")],
                                  params=params) for i in range(2 * engines)]
        await asyncio.gather(*(generate(stub, r, api_key=api_key("warmup", i), timeout_s=600)
                               for i, r in enumerate(requests)))


def run(args: argparse.Namespace, model_dir: Path) -> Row:
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = system_prompts(tokenizer, args.tenants, args.system_tokens)
    schedule = arrivals(args, tokenizer)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp, start_fleet(
        args, model_dir, Path(args.work_dir or tmp)
    ) as fleet:
        addresses = router_addresses(fleet)
        asyncio.run(warm_up(addresses["prefix"], prompts, args.engines))
        for policy in args.policies:
            print(f"running {policy}: {args.num_requests} requests at {args.rate}/s ...",
                  flush=True)
            completions, makespan = asyncio.run(
                run_policy(addresses[policy], policy, schedule, prompts, args.output_len))
            rows.append(summarize(policy, schedule, completions, makespan))
            print_table(rows[-1:])
    return {"rows": rows, "load_before": load_before, "load_after": os.getloadavg()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--num-kv-blocks", type=int, default=192, help="KV blocks per engine")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=96, help="per policy")
    # Above every policy's capacity on a 2-core machine, so throughput measures capacity.
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals, requests/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--work-dir", default=None, help="keep keys and service logs here")
    p.add_argument("--out", type=Path, default=Path("bench_results/serve.json"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from engine.models.default_model import prepare_default_model

        model_dir = prepare_default_model()
    try:
        result = run(args, model_dir)
    except grpc.aio.AioRpcError as e:
        print(f"request failed: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    rows = result["rows"]
    print_table(rows)
    summary = verdict(rows) if {"prefix", "round_robin"} <= set(args.policies) else {}
    if summary:
        print(f"\nprefix vs round_robin throughput: {summary['speedup_vs_round_robin']:.2f}x "
              f"(target >= {TARGET_SPEEDUP}x with lower p99 TTFT): "
              f"{'met' if summary['met'] else 'NOT met'}")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["model"] = str(model_dir)
    report = {"config": config, "machine": platform.platform(), "cpus": os.cpu_count(),
              **result, "verdict": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
