"""Fleet benchmark (`make bench-fleet`, issue 35): kvfleet's 2-engine fleet vs 2 x `vllm serve`
behind sglang-router, and one engine with each system's defaults.

Client: vLLM's own `vllm bench serve` from .venv-peers for every system (openai backend,
/v1/completions, streaming, `--ignore-eos --temperature 0 --seed S`), sending the same text
prompts to all (a `custom` dataset file, see benchmarks/fleet_prompts.py: sglang-router takes
text only), at Poisson `--rates` (2, 4, 8 req/s) and rate inf.
Cases (`--cases`): `prefix_repetition` (vLLM's dataset: 8 prefixes x 512 tokens + 32, 32
out, 96 prompts) and `multi_tenant` (24 tenants, 1,024-token system prompts, 2 users x 2 turns
each, follow-ups carrying the conversation).
Systems (`--systems`, benchmarks/fleet_systems.py): kvfleet-prefix and kvfleet-round_robin (2
engines x 1 torch thread, router policy), sglang-cache_aware and sglang-round_robin (2 x vllm
serve, one bound to each core, behind sglang-router 0.3.2). Every system is started fresh for
every case and rate (no run finds another's cache), warmed with `--num-warmups` (16) short
unrelated requests, measured, then stopped; systems take turns going first from rate to rate.
Reported per case and system: req/s, TTFT mean / p50 / p99, TPOT mean (bench serve's figures);
prefix-cache hit rate (each engine's Prometheus counters, `kvfleet:` / `vllm:`
prefix_cache_hits / prefix_cache_queries, read before and after the run), and the ceiling:
hits possible if every shared prefix were computed once, over all prompt tokens, token-level
and in whole blocks of each system's block size (benchmarks/fleet_metrics.py); requests per
engine (request_success counters); kvfleet-prefix / sglang-cache_aware and / kvfleet-round_robin
ratios; PASS/MISS per target (benchmarks/fleet_report.py).
`--single-engine-defaults`: instead, kvfleet-defaults (`kvfleet up --engines 1`) vs
vllm-defaults (`vllm serve`, defaults), random 256 in / 64 out, 64 prompts, rate inf,
`--rounds` (3) alternated rounds, each system fresh every round; target >= 1.1x req/s with
mean TTFT and TPOT no worse, in every round.
Results: bench_results/fleet_bench.json (--out; fleet_bench_defaults.json in the defaults
mode), rewritten after every case; bench serve's raw results, logs and every server's logs
beside it, in a folder of the same name.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import fleet_metrics, fleet_prompts, fleet_report, fleet_systems, machine, report
from benchmarks.online import dataset_args, summary
from benchmarks.vllm_runner import PeerConfig, PeerError
from benchmarks.vllm_serving import bench_serve
from kvfleet.fleet import FleetError
from kvfleet.text.tokenizer import Tokenizer

Row = dict[str, Any]
DEFAULT_RATES = "2,4,8,inf"
# Each engine's KV cache (GiB), as VLLM_CPU_KVCACHE_SPACE for the vLLM peers; the fleet
# simulator's engines have it too (benchmarks/fleet_sim/calibration.py).
DEFAULT_KVCACHE_GIB = 2
_SETTLE_S = 10.0


@dataclass(frozen=True)
class Ctx:
    model_dir: Path
    args: argparse.Namespace
    cfg: PeerConfig
    work: Path


def parse_rates(text: str) -> list[float | None]:
    """"2,4,inf" -> [2.0, 4.0, None] (None: rate inf, every request at once)."""
    rates: list[float | None] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        rate = float(part)
        if rate <= 0:
            raise ValueError(f"a rate must be > 0, got {part}")
        rates.append(None if rate == float("inf") else rate)
    return rates


def rate_label(rate: float | None) -> str:
    return "inf" if rate is None else f"{rate:g}"


def settle(handle: fleet_systems.Handle, before: fleet_metrics.Snapshot,
           expected: int) -> fleet_metrics.Snapshot:
    """The engines' counters once they count `expected` more finished requests (or after
    _SETTLE_S): a server may publish its last stats a moment after the client is done."""
    deadline = time.monotonic() + _SETTLE_S
    while True:
        after = fleet_systems.scrape(handle)
        done = sum(v["request_success"] for v in fleet_metrics.delta(before, after).values())
        if done >= expected or time.monotonic() > deadline:
            return after
        time.sleep(0.5)


def run_system(system: str, ctx: Ctx, dataset: list[str], num_prompts: int, rate: float | None,
               seed: int, stem: str, tokens: list[list[int]] | None) -> tuple[Row, list[str]]:
    """One fresh `system`: start, warm up, snapshot counters, bench serve, snapshot, stop."""
    args, work = ctx.args, ctx.work
    with fleet_systems.start(system, ctx.model_dir, args, ctx.cfg, work / stem) as handle:
        fleet_systems.warm_up(handle, ctx.model_dir.name, args.num_warmups)
        before = fleet_systems.scrape(handle)
        reasons_before = fleet_systems.decision_reasons(handle)
        holds_before = fleet_systems.decision_holds(handle)
        raw = bench_serve(handle.base_url, ctx.model_dir.name, ctx.model_dir, dataset, ctx.cfg,
                          work / f"{stem}.json", work / f"{stem}.log", num_prompts=num_prompts,
                          num_warmups=0, seed=seed, timeout_s=args.timeout_s,
                          request_rate=rate)
        change = fleet_metrics.delta(before, settle(handle, before, int(raw.get("completed", 0))))
        reasons = {k: round(v - reasons_before.get(k, 0.0))
                   for k, v in sorted(fleet_systems.decision_reasons(handle).items())}
        holds = {k: v - holds_before.get(k, 0.0)
                 for k, v in fleet_systems.decision_holds(handle).items()}
    row = summary(raw)
    row.update(
        hit_rate=fleet_metrics.hit_rate(change), block_size=handle.block_size,
        ceiling=None if tokens is None else fleet_metrics.prefix_ceiling(tokens,
                                                                         handle.block_size),
        requests_per_engine=fleet_metrics.requests_per_engine(change),
        prefix_cache_queries=sum(v["prefix_cache_queries"] for v in change.values()),
        prefix_cache_hits=sum(v["prefix_cache_hits"] for v in change.values()))
    if reasons:
        row["decision_reasons"] = {k: v for k, v in reasons.items() if v}
    if holds.get("count"):
        row["decision_hold"] = {"count": round(holds["count"]),
                                "mean_ms": round(1e3 * holds["sum"] / holds["count"], 2),
                                "within_10ms": round(holds.get("within_10ms", 0.0))}
    return row, handle.lines


def run_safely(system: str, ctx: Ctx, *a: Any, lines: list[str], **kw: Any) -> Row:
    """run_system, a failure recorded in the row (the other systems and cases still run)."""
    print(f"  {system} ...", flush=True)
    try:
        row, started = run_system(system, ctx, *a, **kw)
    except (PeerError, FleetError, OSError) as e:
        print(f"  {system} failed: {e}", flush=True)
        return {"error": str(e)}
    lines.extend(x for x in started if x not in lines)
    return row


def shape(case: str, rate: float | None, n: int, args: argparse.Namespace) -> str:
    at = "rate inf" if rate is None else f"Poisson {rate:g} req/s"
    if case == "prefix_repetition":
        what = (f"{args.num_prefixes} prefixes x {args.prefix_len} + {args.suffix_len} tokens")
    else:
        what = (f"{args.tenants} tenants x {args.system_tokens}-token system prompt, "
                f"{args.users} users x {args.turns} turns of ~{args.user_tokens} tokens")
    return f"{n} prompts, {what}, {args.output_len} out, {at}"


def run_cases(ctx: Ctx, res: Row, out: Path) -> None:
    args = ctx.args
    tokenizer = Tokenizer.from_dir(ctx.model_dir)
    for ci, case in enumerate(args.cases):
        seed = args.seed + ci
        path = ctx.work / f"{case}-seed{seed}.jsonl"
        prompts = fleet_prompts.write_case(case, path, ctx.model_dir, tokenizer, args, ctx.cfg,
                                           seed)
        tokens = [tokenizer.encode(p) for p in prompts]
        dataset = fleet_prompts.custom_dataset_args(path, args.output_len)
        for ri, rate in enumerate(args.rates):
            key = f"{case}@{rate_label(rate)}"
            print(f"{key} ({len(prompts)} prompts)", flush=True)
            order = args.systems[ri % len(args.systems):] + args.systems[:ri % len(args.systems)]
            rows = {s: run_safely(s, ctx, dataset, len(prompts), rate, seed, f"{key}-{s}",
                                  tokens, lines=res["system_lines"]) for s in order}
            res["cases"][key] = {
                "case": case, "rate": rate, "shape": shape(case, rate, len(prompts), args),
                "num_prompts": len(prompts),
                "ceiling_token": fleet_metrics.prefix_ceiling(tokens),
                "systems": {s: rows[s] for s in args.systems}}
            save(res, out)
            fleet_report.print_case(key, res["cases"][key])
            print(flush=True)


def run_defaults(ctx: Ctx, res: Row, out: Path) -> None:
    args = ctx.args
    dataset = dataset_args("random", args)
    res["defaults_shape"] = (f"random {args.input_len} in / {args.output_len} out, "
                             f"{args.num_prompts} prompts, rate inf")
    for r in range(args.rounds):
        order = args.systems if r % 2 == 0 else args.systems[::-1]
        print(f"defaults round {r}", flush=True)
        rows = {s: run_safely(s, ctx, dataset, args.num_prompts, None, args.seed + 100 + r,
                              f"defaults-r{r}-{s}", None, lines=res["system_lines"])
                for s in order}
        res["rounds"].append({s: rows[s] for s in args.systems})
        save(res, out)
        fleet_report.print_round(r, res["defaults_shape"], res["rounds"][-1])
        print(flush=True)


def save(res: Row, out: Path) -> None:
    res["targets"] = targets(res)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")


def targets(res: Row) -> list[Row]:
    found = [v for key, case in res["cases"].items()
             for v in fleet_report.case_verdicts(key, case["rate"], case["systems"])]
    return found + fleet_report.defaults_verdicts(res["rounds"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--single-engine-defaults", action="store_true",
                   help="one engine, each system's defaults, random dataset, rate inf")
    p.add_argument("--systems", default=None, help="default: every system of the mode: "
                   f"{','.join(fleet_systems.FLEET_SYSTEMS)} (or "
                   f"{','.join(fleet_systems.DEFAULT_SYSTEMS)})")
    p.add_argument("--cases", default=",".join(fleet_prompts.CASES))
    p.add_argument("--rates", default=DEFAULT_RATES, help="req/s, Poisson; inf: all at once")
    p.add_argument("--num-prompts", type=int, default=None, help="default 96 (defaults: 64)")
    p.add_argument("--output-len", type=int, default=None, help="default 32 (defaults: 64)")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--tenants", type=int, default=24)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--users", type=int, default=2, help="users per tenant")
    p.add_argument("--turns", type=int, default=2, help="turns per user")
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256, help="random dataset (defaults mode)")
    p.add_argument("--rounds", type=int, default=3, help="defaults mode: alternated rounds")
    p.add_argument("--num-warmups", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kvcache-gib", type=int, default=DEFAULT_KVCACHE_GIB,
                   help="KV cache of each engine")
    p.add_argument("--vllm-eager", action="store_true", help="vllm serve --enforce-eager")
    p.add_argument("--kvfleet-engine-arg", action="append", default=[], metavar="ARG",
                   help="extra engine flag for every kvfleet system, after the bench's own "
                   "(repeat; use =, e.g. --kvfleet-engine-arg=--max-num-batched-tokens=512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per bench serve run")
    p.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M)")
    p.add_argument("--out", default=None, help="default: bench_results/fleet_bench.json "
                   "(defaults mode: bench_results/fleet_bench_defaults.json)")
    args = p.parse_args(argv)
    defaults = args.single_engine_defaults
    allowed = fleet_systems.DEFAULT_SYSTEMS if defaults else fleet_systems.FLEET_SYSTEMS
    args.systems = [s.strip() for s in (args.systems or ",".join(allowed)).split(",")
                    if s.strip()]
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not args.systems or not set(args.systems) <= set(allowed):
        p.error(f"--systems: choose from {', '.join(allowed)}")
    if not args.cases or not set(args.cases) <= set(fleet_prompts.CASES):
        p.error(f"--cases: choose from {', '.join(fleet_prompts.CASES)}")
    try:
        args.rates = parse_rates(args.rates)
    except ValueError as e:
        p.error(f"--rates: {e}")
    args.out = args.out or ("bench_results/fleet_bench_defaults.json" if defaults
                            else "bench_results/fleet_bench.json")
    args.num_prompts = args.num_prompts or (64 if defaults else 96)
    args.output_len = args.output_len or (64 if defaults else 32)
    if not args.rates or min(args.num_prompts, args.output_len, args.rounds) < 1:
        p.error("--rates, --num-prompts, --output-len and --rounds must be non-empty / >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from engine.models.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    model_dir, out = Path(args.model), Path(args.out)
    tcmalloc = machine.find_tcmalloc()
    cfg = PeerConfig(cache_dir=out.parent / "peer-cache", threads=2,
                     kvcache_space_gib=args.kvcache_gib, tcmalloc=tcmalloc,
                     enforce_eager=args.vllm_eager)
    ctx = Ctx(model_dir, args, cfg, out.parent / out.stem)
    t0, load_before = time.perf_counter(), os.getloadavg()
    cpu = machine.cpu_info()
    res: Row = {"config": {**vars(args), "model": model_dir.name}, "cpu": cpu,
                "system_lines": [report.cpu_line(cpu),
                                 f"vLLM allocator: {tcmalloc or 'glibc malloc (no tcmalloc)'}",
                                 "client: vllm bench serve (.venv-peers), same machine"],
                "cases": {}, "rounds": [], "targets": []}
    if args.single_engine_defaults:
        run_defaults(ctx, res, out)
    else:
        run_cases(ctx, res, out)
    res.update(total_run_s=time.perf_counter() - t0,
               loadavg_before=[round(x, 2) for x in load_before],
               loadavg_after=[round(x, 2) for x in os.getloadavg()])
    save(res, out)
    fleet_report.print_report(res)
    print(f"\ntotal run time {res['total_run_s']:.1f} s; load average before "
          f"{res['loadavg_before']}, after {res['loadavg_after']}")
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
