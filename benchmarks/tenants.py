"""`make bench-tenants`: one tenant floods, another chats; FCFS vs fair share (issue 14).

Fleet: kvfleet/fleet.py's local fleet (a real Redis, the tokenizer, `--engines` (2) engines of
`--engine-threads` (1) torch threads, one router) on SmolLM2, with two tenants (API keys):
- A floods: `--flood-concurrency` (8) workers, each sending a fresh `--flood-tokens` (2,000)
  random-token prompt (`--flood-output` greedy tokens) as soon as its previous one ends;
- B chats: short chat turns (~`--chat-words` words, `--chat-output` tokens) at Poisson times,
  `--chat-interval` s apart on average, the same schedule in every phase.
Phases, each `--duration` s of measured time (A's flood starts `--ramp` s earlier so the
engines are saturated when measuring starts):
1. B alone (no flood);
2. A's flood + B on engines with `--scheduling-policy fcfs`;
3. A's flood + B on engines with `--scheduling-policy fair` (the default).
A fleet is started per policy (phase 1 runs on the FCFS one: a lone tenant is scheduled the
same under both policies, which a unit test checks step by step).

Reported per phase: B's TTFT p50 / p99 / max (client side, send to first token), the engines'
total throughput (tokens scheduled per second: prompt chunks + generated tokens, from the
engines' `kvfleet:iteration_tokens_total` sums over the window, so in-flight work counts) and
A's requests completed in the window. Targets: B's p99 TTFT under the flood with fair share at
most 2x B alone; fair-share throughput at least 0.95x FCFS; A keeps completing requests.
Results: bench_results/tenants.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.workload import random_prompts
from kvfleet.fleet import Fleet, FleetConfig
from kvfleet.router_client import build_request, channel, generate
from kvfleet.v1 import common_pb2, router_pb2_grpc

Row = dict[str, Any]
TARGET_TTFT_RATIO = 2.0
TARGET_THROUGHPUT = 0.95
KEYS = {"flood": "key-tenant-a", "chat": "key-tenant-b"}
WORDS = ("river", "mountain", "forest", "ocean", "valley", "island", "harbor", "castle",
         "garden", "bridge", "market", "winter", "summer", "lantern", "engine", "signal")


def write_policy(path: Path) -> Path:
    path.write_text(json.dumps({"tenants": {"tenant-a": [KEYS["flood"]],
                                            "tenant-b": [KEYS["chat"]]}}))
    return path


def chat_schedule(args: argparse.Namespace) -> list[tuple[float, str]]:
    """(send time in s from the window's start, user turn): the same in every phase."""
    rng = random.Random(args.seed)
    at, out = rng.uniform(0, args.chat_interval), []
    while at < args.duration:
        words = " ".join(rng.choice(WORDS) for _ in range(args.chat_words))
        out.append((at, f"In one sentence, what links these words: {words}?"))
        at += rng.expovariate(1 / args.chat_interval)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def scheduled_tokens(fleet: Fleet) -> float:
    """Tokens every engine has scheduled so far (prompt chunks + generated tokens)."""
    total = 0.0
    for engine in fleet.engines:
        with urllib.request.urlopen(engine.metrics_url, timeout=30) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith("kvfleet:iteration_tokens_total_sum"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _chat(stub: router_pb2_grpc.RouterStub, schedule: Sequence[tuple[float, str]],
                output: int, started: float) -> list[float]:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)

    async def one(at: float, turn: str) -> float:
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        request = build_request(messages=[("user", turn)], params=params)
        done = await generate(stub, request, api_key=KEYS["chat"], timeout_s=600)
        assert done.ttft_s is not None and done.num_tokens == output, done
        return done.ttft_s

    return list(await asyncio.gather(*(one(at, turn) for at, turn in schedule)))


async def _flood_worker(stub: router_pb2_grpc.RouterStub, args: argparse.Namespace,
                        rng: random.Random, vocab: int, window: list[float],
                        completed: list[float]) -> None:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=args.flood_output,
                                       ignore_eos=True)
    while True:
        (prompt,) = random_prompts(rng, 1, args.flood_tokens, args.flood_tokens, vocab, set())
        request = build_request(prompt_token_ids=prompt, params=params)
        done = await generate(stub, request, api_key=KEYS["flood"], timeout_s=1800)
        now = time.monotonic()
        if done.num_tokens == args.flood_output and window[0] <= now <= window[1]:
            completed.append(now)


async def run_phase(fleet: Fleet, args: argparse.Namespace, flood: bool, vocab: int) -> Row:
    schedule = chat_schedule(args)
    rng = random.Random(args.seed + 1)
    async with channel(fleet.router_address) as chan:
        stub = router_pb2_grpc.RouterStub(chan)
        window = [float("inf"), float("inf")]
        completed: list[float] = []
        workers = [asyncio.create_task(_flood_worker(stub, args, rng, vocab, window, completed))
                   for _ in range(args.flood_concurrency if flood else 0)]
        try:
            if flood:
                await asyncio.sleep(args.ramp)
            tokens_before, started = scheduled_tokens(fleet), time.monotonic()
            window[:] = [started, started + args.duration]
            ttfts = await _chat(stub, schedule, args.chat_output, started)
            await asyncio.sleep(max(0.0, window[1] - time.monotonic()))
            elapsed = time.monotonic() - started
            tokens = scheduled_tokens(fleet) - tokens_before
        finally:
            for worker in workers:
                worker.cancel()
            for worker in workers:
                with contextlib.suppress(asyncio.CancelledError):
                    await worker
                if not worker.cancelled() and worker.exception() is not None:
                    raise RuntimeError("a flood request failed") from worker.exception()
    return {"chats": len(ttfts), "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": percentile(ttfts, 99), "ttft_max_s": max(ttfts), "ttfts_s": sorted(ttfts),
            "throughput_tok_s": tokens / elapsed, "flood_completed": len(completed),
            "window_s": elapsed}


def start_fleet(args: argparse.Namespace, model_dir: Path, work: Path, policy: str) -> Fleet:
    config = FleetConfig(
        model_dir=model_dir, num_engines=args.engines, engine_threads=args.engine_threads,
        api_keys=write_policy(work / "policy.json"),
        engine_args=("--scheduling-policy", policy,
                     "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                     *args.engine_arg),
        log_dir=work / f"logs-{policy}", log_level="WARNING")
    return Fleet(config).start()


async def warm_up(fleet: Fleet, vocab: int) -> None:
    """A long and a short request per engine: first-step costs out of every phase."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rng = random.Random(99)
    async with channel(fleet.router_address) as chan:
        stub = router_pb2_grpc.RouterStub(chan)
        prompts = random_prompts(rng, 2 * len(fleet.engines), 16, 1024, vocab, set())
        await asyncio.gather(*(generate(stub, build_request(prompt_token_ids=p, params=params),
                                        api_key=KEYS["chat"], timeout_s=600) for p in prompts))


def run(args: argparse.Namespace, model_dir: Path) -> Row:
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    phases: Row = {}
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-tenants-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for policy in ("fcfs", "fair"):
            with start_fleet(args, model_dir, work, policy) as fleet:
                asyncio.run(warm_up(fleet, vocab))
                if policy == "fcfs":
                    print("B alone ...", flush=True)
                    phases["alone"] = asyncio.run(run_phase(fleet, args, False, vocab))
                    print_rows({"alone": phases["alone"]})
                print(f"A's flood + B, {policy} ...", flush=True)
                phases[f"flood_{policy}"] = asyncio.run(run_phase(fleet, args, True, vocab))
                print_rows({f"flood_{policy}": phases[f"flood_{policy}"]})
    return phases


def verdict(phases: Row) -> Row:
    alone, fcfs, fair = phases["alone"], phases["flood_fcfs"], phases["flood_fair"]
    ttft_ratio = fair["ttft_p99_s"] / alone["ttft_p99_s"]
    throughput_ratio = fair["throughput_tok_s"] / fcfs["throughput_tok_s"]
    return {"fair_p99_ttft_over_alone": ttft_ratio,
            "fcfs_p99_ttft_over_alone": fcfs["ttft_p99_s"] / alone["ttft_p99_s"],
            "fair_throughput_over_fcfs": throughput_ratio,
            "ttft_met": ttft_ratio <= TARGET_TTFT_RATIO,
            "throughput_met": throughput_ratio >= TARGET_THROUGHPUT,
            "flood_not_starved": fair["flood_completed"] > 0}


def print_rows(phases: Row) -> None:
    for name, r in phases.items():
        print(f"  {name:<12} B TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms  p99 "
              f"{r['ttft_p99_s'] * 1e3:8.1f} ms  max {r['ttft_max_s'] * 1e3:8.1f} ms  "
              f"({r['chats']} chats)  throughput {r['throughput_tok_s']:7.1f} tok/s  "
              f"A completed {r['flood_completed']}", flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads per engine")
    # The engines' step token budget: a short request that arrives waits for the step in
    # flight, which at 2,048 tokens is seconds on one CPU thread (docs/tenants.md).
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra engine flag (repeatable), e.g. --engine-arg=--num-kv-blocks=512")
    p.add_argument("--flood-concurrency", type=int, default=8)
    p.add_argument("--flood-tokens", type=int, default=2000)
    p.add_argument("--flood-output", type=int, default=16)
    p.add_argument("--chat-words", type=int, default=12)
    p.add_argument("--chat-output", type=int, default=16)
    p.add_argument("--chat-interval", type=float, default=1.5, help="mean seconds between chats")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds per phase")
    p.add_argument("--ramp", type=float, default=10.0, help="flood seconds before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None, help="keep the policy file and service logs")
    p.add_argument("--out", type=Path, default=Path("bench_results/tenants.json"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from engine.models.default_model import prepare_default_model

        model_dir = prepare_default_model()
    load_before = os.getloadavg()
    phases = run(args, model_dir)
    summary = verdict(phases)
    print("\nB's TTFT and total throughput (tokens scheduled per second)")
    print_rows(phases)
    print(f"B's p99 TTFT under the flood vs alone: fcfs "
          f"{summary['fcfs_p99_ttft_over_alone']:.1f}x, fair "
          f"{summary['fair_p99_ttft_over_alone']:.1f}x (target <= {TARGET_TTFT_RATIO}x): "
          f"{'met' if summary['ttft_met'] else 'NOT met'}")
    print(f"throughput fair / fcfs: {summary['fair_throughput_over_fcfs']:.3f} "
          f"(target >= {TARGET_THROUGHPUT}): {'met' if summary['throughput_met'] else 'NOT met'}"
          f"; A completed {phases['flood_fair']['flood_completed']} under fair share")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["model"] = str(model_dir)
    report = {"config": config, "cpus": os.cpu_count(), "load_before": load_before,
              "load_after": os.getloadavg(), "phases": phases, "verdict": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
