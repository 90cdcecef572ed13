"""`make bench` scenario G: the KV memory tiers (issue 17), kvfleet alone, offline.

- G1, host tier: a multi-turn chat workload whose working set is `--working-set-factor` (3)
  times the device KV pool. `--chats` conversations take turns round-robin; each turn sends
  the whole conversation so far plus `--turn-tokens` new random tokens and generates
  `--output-tokens` greedy tokens, one request at a time, so by the time a chat comes back
  the others have pushed its blocks off the device. Run with recompute only (no host tier)
  and with a host tier that holds the working set; per mode: TTFT p50 / p99 (add_request to
  first token), output tokens/s, and prompt tokens served from each tier. Target: p50 TTFT
  with the tier at least 2x better.
- G2, preemption-heavy load: `--burst` long requests at once on a pool that holds a fraction
  of them (prefix caching off); recompute vs swap vs auto, the median of `--repeats` runs:
  wall time, output tokens/s and TTFT p50. `auto` is expected to be no worse than the better
  of the two. `--scenarios` picks G1 and/or G2.
Both check that every mode's greedy tokens are identical. Results: bench_results/kv_tiers.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from engine.models.default_model import prepare_default_model

BLOCK_SIZE = 16


def _token_range(model: str) -> tuple[int, int]:
    """Random ids away from the special (low) and rarely trained (high) ends of the vocab."""
    vocab = ModelConfig.from_dir(Path(model)).vocab_size
    margin = min(100, vocab // 4)
    return margin, vocab - margin


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _drive(llm: LLM, requests: list[tuple[str, list[int]]], params: SamplingParams
           ) -> tuple[list[list[int]], list[float], float]:
    """Add every request, step to the end; (outputs, TTFTs in s, wall s)."""
    engine = llm.engine
    start = time.perf_counter()
    added, first = {}, {}
    handles = []
    for request_id, prompt in requests:
        added[request_id] = time.perf_counter()
        handles.append(engine.add_request(request_id, prompt, params))
    while engine.has_unfinished_requests():
        for update in engine.step():
            rid = update.request.request_id
            if rid not in first and update.new_token_ids:
                first[rid] = time.perf_counter()
    wall = time.perf_counter() - start
    return ([h.output_token_ids for h in handles],
            [first[r] - added[r] for r, _ in requests], wall)


def chat_workload(model: str, args: argparse.Namespace, host_tier: bool) -> dict[str, Any]:
    rng = random.Random(args.seed)
    lo, hi = _token_range(model)
    turns_tokens = args.turns * (args.turn_tokens + args.output_tokens)
    working_set = args.chats * -(-turns_tokens // BLOCK_SIZE)
    device_blocks = max(working_set // args.working_set_factor, -(-turns_tokens // BLOCK_SIZE) + 1)
    extra: dict[str, Any] = {"num_host_kv_blocks": working_set} if host_tier else {}
    llm = LLM(model, dtype=args.dtype, num_kv_blocks=device_blocks, seed=args.seed, **extra)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    chats: list[list[int]] = [[] for _ in range(args.chats)]
    ttfts, outputs = [], []
    wall = 0.0
    for turn in range(args.turns):
        for index, chat in enumerate(chats):
            chat.extend(rng.randrange(lo, hi) for _ in range(args.turn_tokens))
            outs, ttft, step_wall = _drive(llm, [(f"c{index}t{turn}", list(chat))], params)
            chat.extend(outs[0])
            outputs.append(outs[0])
            if turn > 0:  # first turns are cold in both modes
                ttfts.extend(ttft)
            wall += step_wall
    stats = llm.get_stats()
    return {
        "mode": "host_tier" if host_tier else "recompute_only",
        "device_blocks": device_blocks, "working_set_blocks": working_set,
        "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": _percentile(ttfts, 0.99),
        "output_tok_s": sum(len(o) for o in outputs) / wall,
        "device_hit_tokens": stats["prefix_cache_hits"],
        "host_hit_tokens": stats["prefix_cache_host_hits"],
        "kv_bytes_to_host": stats["kv_transfer_bytes_to_host"],
        "kv_bytes_to_device": stats["kv_transfer_bytes_to_device"],
        "outputs": outputs,
    }


def preemption_workload(model: str, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    lo, hi = _token_range(model)
    prompts = [[rng.randrange(lo, hi) for _ in range(args.burst_prompt_tokens)]
               for _ in range(args.burst)]
    per_request = -(-(args.burst_prompt_tokens + args.burst_output_tokens) // BLOCK_SIZE)
    # Room for a third of the prompts and half a block each to grow into: admission fills the
    # pool with prompts, then their decodes run out of blocks and preempt, over and over. (A
    # pool of whole requests, prompt + output, is never short and never preempts.)
    admitted = max(1, args.burst // 3)
    device_blocks = admitted * -(-args.burst_prompt_tokens // BLOCK_SIZE) + admitted // 2 + 1
    llm = LLM(model, dtype=args.dtype, num_kv_blocks=device_blocks, seed=args.seed,
              preemption_mode=mode, num_swap_blocks=per_request * args.burst,
              swap_min_computed_tokens=args.swap_min_computed_tokens,
              # Repeats send the same prompts: no hits from the run before.
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.burst_output_tokens, ignore_eos=True)
    _drive(llm, [("warm", prompts[0][:32])], params)  # first-step costs out of the timing
    runs = [_drive(llm, [(f"r{r}b{i}", p) for i, p in enumerate(prompts)], params)
            for r in range(args.repeats)]
    # The run with the median wall time (odd repeats) stands for the mode.
    outs, ttfts, wall = sorted(runs, key=lambda run: run[2])[len(runs) // 2]
    stats = llm.get_stats()
    return {
        "mode": mode, "device_blocks": device_blocks, "wall_s": wall,
        "output_tok_s": sum(len(o) for o in outs) / wall,
        "ttft_p50_s": statistics.median(ttfts), "repeats": args.repeats,
        "num_preemptions": stats["num_preemptions"] // args.repeats,
        "swapped_out_blocks": stats["swapped_out_blocks"] // args.repeats, "outputs": outs,
    }


def run_g1(model: str, args: argparse.Namespace) -> dict[str, Any]:
    g1 = [chat_workload(model, args, host_tier) for host_tier in (False, True)]
    g1_same = g1[0].pop("outputs") == g1[1].pop("outputs")
    report = {"G1_host_tier": g1, "G1_identical_tokens": g1_same,
              "G1_ttft_p50_speedup": g1[0]["ttft_p50_s"] / g1[1]["ttft_p50_s"]}
    print("G1 multi-turn chats, working set", g1[0]["working_set_blocks"], "blocks, device",
          g1[0]["device_blocks"])
    for row in g1:
        print(f"  {row['mode']:15s} TTFT p50 {row['ttft_p50_s'] * 1e3:8.1f} ms  p99 "
              f"{row['ttft_p99_s'] * 1e3:8.1f} ms  {row['output_tok_s']:7.1f} out tok/s  "
              f"hits device {row['device_hit_tokens']} host {row['host_hit_tokens']}")
    print(f"  p50 TTFT speedup with the host tier: {report['G1_ttft_p50_speedup']:.2f}x "
          f"(target >= 2x); identical tokens: {g1_same}")
    return report


def run_g2(model: str, args: argparse.Namespace) -> dict[str, Any]:
    g2 = [preemption_workload(model, args, mode) for mode in ("recompute", "swap", "auto")]
    g2_outputs = [row.pop("outputs") for row in g2]
    report = {"G2_preemption": g2,
              "G2_identical_tokens": all(o == g2_outputs[0] for o in g2_outputs),
              "G2_auto_vs_best": min(r["wall_s"] for r in g2[:2]) / g2[2]["wall_s"]}
    print(f"G2 preemption-heavy burst ({args.burst} x {args.burst_prompt_tokens} + "
          f"{args.burst_output_tokens} tokens, device {g2[0]['device_blocks']} blocks; "
          f"median of {args.repeats} runs)")
    for row in g2:
        print(f"  {row['mode']:10s} wall {row['wall_s']:7.2f} s  {row['output_tok_s']:7.1f} "
              f"out tok/s  TTFT p50 {row['ttft_p50_s']:6.2f} s  preemptions "
              f"{row['num_preemptions']}  swapped-out blocks {row['swapped_out_blocks']}")
    print(f"  auto vs the better of recompute/swap: {report['G2_auto_vs_best']:.2f}x "
          f"(target >= 1, within noise); identical tokens: {report['G2_identical_tokens']}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--working-set-factor", type=int, default=3)
    parser.add_argument("--burst", type=int, default=12)
    parser.add_argument("--burst-prompt-tokens", type=int, default=384)
    parser.add_argument("--burst-output-tokens", type=int, default=64)
    parser.add_argument("--swap-min-computed-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3,
                        help="G2 runs per mode; the median wall time is reported")
    parser.add_argument("--scenarios", default="G1,G2", help="which of G1, G2 to run")
    parser.add_argument("--out", type=Path, default=Path("bench_results/kv_tiers.json"))
    args = parser.parse_args(argv)
    model = args.model or str(prepare_default_model())

    scenarios = {name.strip().upper() for name in args.scenarios.split(",")}
    report: dict[str, Any] = {}
    if "G1" in scenarios:
        report.update(run_g1(model, args))
    if "G2" in scenarios:
        report.update(run_g2(model, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
