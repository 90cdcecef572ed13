"""Offline benchmark: kvfleet against transformers on one workload, in one process and run.

Scenarios (SmolLM2-135M, `torch.set_num_threads(2)`, float32 unless --dtype):

- A, offline throughput: N requests (default 32), prompts of uniform random length 16-256 made of
  random non-special token ids, `--output-len` (default 64) greedy tokens each, EOS ignored.
  kvfleet `LLM.generate` (one call) vs transformers `generate_batch` (continuous batching,
  16-token pages) and `generate` (static batches of 8, left padded). Each system gets one small
  untimed warm-up; then `--repeats` rounds (default 3) run the three systems in turn and the
  median wall time counts. Sanity: kvfleet's greedy tokens vs each peer's for the first requests.
- B, prefix cache: a 1,024-token shared prefix + 16 unique tokens, `max_tokens=1`. TTFT (wall
  time of the generate call) cold (prefix cache reset) vs cached (same prefix, new unique
  tokens); medians over repeats; tokens computed = prompt tokens - num_cached_tokens.
  transformers `generate(max_new_tokens=1)` on the same 1,040 tokens for context.
- C, KV waste: A's requests driven through `engine.add_request` / `step()` in a separate untimed
  pass. Sampled inside every step after scheduling, right before the forward pass (by wrapping
  the runner's `execute` on this instance): allocated = distinct blocks referenced by running
  requests x block_size; held = sum of running requests' `num_tokens`; waste = 1 - held/allocated.
  Reported: mean over steps (plain and weighted by step wall time) and max. `num_tokens` of a
  request still in chunked prefill exceeds its allocated slots, so those steps understate waste;
  `waste_kv` (held = num_computed_tokens + tokens scheduled this step) is in the JSON too, and
  so is the floor for 16-token blocks (every request in exactly ceil(num_tokens/16) blocks).
  The target applies to the plain per-step mean.

Timings are noisy on a shared 2-core machine: the load average before and after is recorded.
Results go to bench_results/offline_throughput.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks import hf_peer
from engine import LLM, SamplingParams
from engine.model_runner import RunnerOutput

TARGET_A = 3.0  # kvfleet >= 3x the better transformers throughput
TARGET_B = 10.0  # cached TTFT >= 10x faster than cold
TARGET_C = 0.04  # mean KV waste < 4%
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256
Row = dict[str, Any]


def random_prompts(
    rng: random.Random, n: int, lo: int, hi: int, vocab: int, banned: set[int]
) -> list[list[int]]:
    """Uniform random lengths in [lo, hi]; ids above every special id (SmolLM2: 0..16)."""
    first = max(banned) + 1 if banned else 0
    return [[rng.randrange(first, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def throughput(name: str, wall: float, prompts: list[list[int]], outs: list[list[int]]) -> Row:
    gen = sum(len(o) for o in outs)
    total = gen + sum(len(p) for p in prompts)
    return {"system": name, "wall_s": wall, "gen_tokens": gen, "total_tokens": total,
            "gen_tok_s": gen / wall, "total_tok_s": total / wall}


def agreement(mine: list[list[int]], theirs: list[list[int]], k: int) -> Row:
    """How many of the first k requests have identical tokens, and where the others diverge."""
    firsts = []
    for a, b in zip(mine[:k], theirs[:k], strict=True):
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                           None if len(a) == len(b) else min(len(a), len(b))))
    return {"checked": len(firsts), "equal": sum(f is None for f in firsts),
            "first_divergence": firsts}


def kv_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outs


def scenario_a(llm: LLM, hf: Any, prompts: list[list[int]], warm: list[list[int]],
               args: argparse.Namespace) -> Row:
    n_out = args.output_len
    kv_blocks = llm.engine.kv.num_blocks
    cb_kwargs: dict[str, Any] = {"page_size": BLOCK_SIZE, "num_blocks": kv_blocks,
                                 "max_batch_tokens": MAX_BATCHED_TOKENS,
                                 "max_requests_per_batch": MAX_NUM_SEQS}
    # Warm-ups (untimed): different prompts so no prefix cache hit carries over.
    kv_generate(llm, warm, 4)
    llm.reset_prefix_cache()
    hf_peer.generate_batch(hf, warm, 4, **cb_kwargs)
    hf_peer.generate_static(hf, warm, 4, args.static_batch)

    # Rounds interleave the systems, so slow phases of a shared machine hit all of them.
    walls: dict[str, list[float]] = {"kv": [], "cb": [], "static": []}
    stats0 = llm.get_stats()
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # each round starts cold, like the peers
        wall, outs = kv_generate(llm, prompts, n_out)
        walls["kv"].append(wall)
        cb = hf_peer.generate_batch(hf, prompts, n_out, **cb_kwargs)
        walls["cb"].append(cb.wall_s)
        static = hf_peer.generate_static(hf, prompts, n_out, args.static_batch)
        walls["static"].append(static.wall_s)
    stats1 = llm.get_stats()
    hf_peer.drop_cb_manager(hf)
    kv_tokens = [list(o.outputs[0].token_ids) for o in outs]
    med = {k: statistics.median(v) for k, v in walls.items()}
    rows = [throughput("kvfleet LLM.generate", med["kv"], prompts, kv_tokens),
            throughput("transformers generate_batch (CB)", med["cb"], prompts, cb.outputs),
            throughput(f"transformers generate (static bs={args.static_batch})",
                       med["static"], prompts, static.outputs)]
    for row, key in zip(rows, walls, strict=True):
        row["wall_samples_s"] = walls[key]
    kv_rate = rows[0]["gen_tok_s"]
    for row in rows[1:]:
        row["kvfleet_ratio"] = kv_rate / row["gen_tok_s"]
    best = max(rows[1:], key=lambda r: float(r["gen_tok_s"]))
    ratio = kv_rate / best["gen_tok_s"]
    return {
        "rows": rows,
        "best_peer": best["system"],
        "kvfleet_over_best_peer": ratio,
        "target": TARGET_A,
        "pass": ratio >= TARGET_A,
        "sanity_vs_generate": agreement(kv_tokens, static.outputs, args.check),
        "sanity_vs_generate_batch": agreement(kv_tokens, cb.outputs, args.check),
        "kvfleet_preemptions": stats1["num_preemptions"] - stats0["num_preemptions"],
        "kvfleet_prefix_hit_tokens": stats1["prefix_cache_hits"] - stats0["prefix_cache_hits"],
        "num_kv_blocks": kv_blocks,
        "repeats": args.repeats,
    }


def scenario_b(llm: LLM, hf: Any, rng: random.Random, vocab: int, banned: set[int],
               args: argparse.Namespace) -> Row:
    prefix = random_prompts(rng, 1, 1024, 1024, vocab, banned)[0]

    def fresh() -> list[int]:
        return prefix + random_prompts(rng, 1, 16, 16, vocab, banned)[0]

    def ttft(prompt: list[int]) -> tuple[float, int]:
        wall, outs = kv_generate(llm, [prompt], 1)
        return wall, len(prompt) - outs[0].num_cached_tokens

    kv_generate(llm, random_prompts(rng, 1, 64, 64, vocab, banned), 1)  # warm-up
    cold: list[tuple[float, int]] = []
    cached: list[tuple[float, int]] = []
    per_cold = max(1, args.repeats_cached // args.repeats_cold)
    for _ in range(args.repeats_cold):
        if not llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused: blocks still in use")
        cold.append(ttft(fresh()))
        cached.extend(ttft(fresh()) for _ in range(per_cold))
    cold_s = statistics.median(w for w, _ in cold)
    cached_s = statistics.median(w for w, _ in cached)
    prompt = fresh()
    hf_peer.ttft(hf, prompt[:64])  # warm-up
    hf_s = statistics.median(hf_peer.ttft(hf, prompt) for _ in range(args.repeats_cold))
    ratio = cold_s / cached_s
    return {
        "prompt_tokens": len(prompt),
        "kvfleet_cold_ttft_s": cold_s,
        "kvfleet_cached_ttft_s": cached_s,
        "cold_over_cached": ratio,
        "cold_tokens_computed": [c for _, c in cold],
        "cached_tokens_computed": [c for _, c in cached],
        "cold_samples_s": [w for w, _ in cold],
        "cached_samples_s": [w for w, _ in cached],
        "transformers_ttft_s": hf_s,
        "target": TARGET_B,
        "pass": ratio >= TARGET_B,
    }


def scenario_c(llm: LLM, prompts: list[list[int]], args: argparse.Namespace) -> Row:
    engine = llm.engine
    llm.reset_prefix_cache()
    # (waste by num_tokens, by KV written, floor: each request in ceil(num_tokens/bs) blocks)
    samples: list[tuple[float, float, float]] = []
    runner = engine.runner
    inner: Callable[..., RunnerOutput] = runner.execute

    def execute(scheduled: list[Any], block_ids: dict[str, list[int]]) -> RunnerOutput:
        new = {s.request.request_id: s.num_new_tokens for s in scheduled}
        running = engine.scheduler.running
        table = engine.kv.req_to_blocks
        blocks = {b.block_id for r in running for b in table.get(r.request_id, [])}
        slots = len(blocks) * engine.kv.block_size
        if slots:
            held = sum(r.num_tokens for r in running)
            bs = engine.kv.block_size
            floor_slots = sum(-(-r.num_tokens // bs) * bs for r in running)
            written = sum(r.num_computed_tokens + new.get(r.request_id, 0) for r in running)
            samples.append((1 - held / slots, 1 - written / slots, 1 - held / floor_slots))
        return inner(scheduled, block_ids)

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"waste-{i}", p, params)
    times: list[float] = []
    runner.execute = execute  # type: ignore[method-assign]
    try:
        while engine.has_unfinished_requests():
            before = len(samples)
            start = time.perf_counter()
            engine.step()
            if len(samples) > before:
                times.append(time.perf_counter() - start)
    finally:
        del runner.execute  # back to the class method
    waste = [w for w, _, _ in samples]
    waste_kv = [w for _, w, _ in samples]
    mean = statistics.fmean(waste)
    return {
        "steps": len(samples),
        "held_definition": "sum of running requests' num_tokens, sampled after scheduling",
        "waste_mean": mean,
        "waste_mean_time_weighted": sum(w * t for w, t in zip(waste, times, strict=True))
        / sum(times),
        "waste_max": max(waste),
        "waste_kv_mean": statistics.fmean(waste_kv),
        "waste_kv_max": max(waste_kv),
        "waste_floor_mean": statistics.fmean(f for _, _, f in samples),
        "target": TARGET_C,
        "pass": mean < TARGET_C,
    }


def pf(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_report(res: Row) -> None:
    print(f"\n== kvfleet offline benchmark ({res['config']['dtype']}, "
          f"{res['config']['threads']} threads, model {res['config']['model']}) ==")
    if a := res.get("A"):
        print(f"\nA. offline throughput: {res['config']['num_requests']} requests, "
              f"prompts 16-256, {res['config']['output_len']} output tokens each, "
              f"median of {a['repeats']} round(s)")
        print(f"{'system':<40}{'wall s':>9}{'gen tok/s':>11}{'total tok/s':>13}{'kvfleet x':>11}")
        for r in a["rows"]:
            ratio = f"{r['kvfleet_ratio']:.2f}x" if "kvfleet_ratio" in r else "-"
            print(f"{r['system']:<40}{r['wall_s']:>9.2f}{r['gen_tok_s']:>11.1f}"
                  f"{r['total_tok_s']:>13.1f}{ratio:>11}")
        print(f"kvfleet / best peer ({a['best_peer']}): {a['kvfleet_over_best_peer']:.2f}x  "
              f"target >= {TARGET_A:.1f}x  {pf(a['pass'])}")
        for key, label in (("sanity_vs_generate", "generate"),
                           ("sanity_vs_generate_batch", "generate_batch")):
            s = a[key]
            print(f"sanity: kvfleet greedy tokens == {label} for {s['equal']}/{s['checked']} "
                  f"requests (first divergence: {s['first_divergence']})")
        print(f"kvfleet preemptions {a['kvfleet_preemptions']}, prefix-hit tokens "
              f"{a['kvfleet_prefix_hit_tokens']}, KV blocks {a['num_kv_blocks']}")
    if b := res.get("B"):
        print(f"\nB. prefix cache: {b['prompt_tokens']}-token prompt (1,024 shared + 16 unique), "
              "max_tokens=1, medians")
        print(f"kvfleet TTFT cold   {b['kvfleet_cold_ttft_s'] * 1e3:9.1f} ms  "
              f"tokens computed {b['cold_tokens_computed']}")
        print(f"kvfleet TTFT cached {b['kvfleet_cached_ttft_s'] * 1e3:9.1f} ms  "
              f"tokens computed {b['cached_tokens_computed']}")
        print(f"cold / cached {b['cold_over_cached']:.1f}x  target >= {TARGET_B:.0f}x  "
              f"{pf(b['pass'])}")
        print(f"transformers generate TTFT (same prompt) {b['transformers_ttft_s'] * 1e3:.1f} ms")
    if c := res.get("C"):
        print(f"\nC. KV waste during A ({c['steps']} steps; held = num_tokens)")
        print(f"mean {c['waste_mean']:.2%} (time-weighted {c['waste_mean_time_weighted']:.2%}), "
              f"max {c['waste_max']:.2%}  target mean < {TARGET_C:.0%}  {pf(c['pass'])}")
        print(f"(held = KV written: mean {c['waste_kv_mean']:.2%}, max {c['waste_kv_max']:.2%}; "
              f"block-granularity floor, ceil(num_tokens/{BLOCK_SIZE}) blocks each: "
              f"mean {c['waste_floor_mean']:.2%})")
    print(f"\ntotal run time {res['total_run_s']:.1f} s; load average before "
          f"{res['env']['loadavg_before']}, after {res['env']['loadavg_after']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--scenarios", default="A,B,C", help="comma-separated subset of A,B,C")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default="bench_results/offline_throughput.json")
    p.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--static-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="A: rounds, median wall time")
    p.add_argument("--check", type=int, default=4, help="requests in the sanity check")
    p.add_argument("--repeats-cold", type=int, default=3)
    p.add_argument("--repeats-cached", type=int, default=6)
    args = p.parse_args(argv)
    args.scenarios = {s.strip().upper() for s in args.scenarios.split(",") if s.strip()}
    if args.repeats < 1 or args.repeats_cold < 1 or args.repeats_cached < 1:
        p.error("repeat counts must be at least 1")
    if not args.scenarios <= {"A", "B", "C"}:
        p.error(f"unknown scenarios: {sorted(args.scenarios - {'A', 'B', 'C'})}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from engine.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    model_dir = Path(args.model)
    loadavg_before = os.getloadavg()
    banned = hf_peer.special_token_ids(model_dir)
    llm = LLM(model=str(model_dir), dtype=args.dtype, seed=args.seed, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=True)
    vocab = llm.engine.model_config.vocab_size
    hf = hf_peer.load_model(model_dir, getattr(torch, args.dtype))
    rng = random.Random(args.seed)
    prompts = random_prompts(rng, args.num_requests, 16, 256, vocab, banned)
    warm = random_prompts(rng, 2, 16, 256, vocab, banned)

    res: Row = {"config": {k: (sorted(v) if isinstance(v, set) else v)
                           for k, v in vars(args).items()}}
    res["config"]["model"] = model_dir.name
    if "A" in args.scenarios:
        res["A"] = scenario_a(llm, hf, prompts, warm, args)
    if "B" in args.scenarios:
        res["B"] = scenario_b(llm, hf, rng, vocab, banned, args)
    if "C" in args.scenarios:
        res["C"] = scenario_c(llm, prompts, args)
    res["total_run_s"] = time.perf_counter() - t0
    res["env"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                  "python": platform.python_version(), "cpu_count": os.cpu_count(),
                  "loadavg_before": [round(x, 2) for x in loadavg_before],
                  "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print_report(res)
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
