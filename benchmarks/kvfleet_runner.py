"""kvfleet's side of the offline benchmark: its `LLM`, timed generate calls, scenarios B and C.

- `kv_generate`: one greedy `LLM.generate` call (EOS ignored), wall time measured around it.
- B, prefix cache: a 1,024-token shared prefix + 16 unique tokens, `max_tokens=1`. TTFT (wall
  time of the generate call) cold (prefix cache reset) vs cached (same prefix, new unique
  tokens); medians over repeats; tokens computed = prompt tokens - num_cached_tokens.
  transformers `generate(max_new_tokens=1)` on the same 1,040 tokens for context.
- C, KV waste: A's requests driven through `engine.add_request` / `step()` in a separate untimed
  pass. Sampled inside every step after scheduling, right before the forward pass (by wrapping
  the runner's `execute` on this instance): allocated = distinct blocks referenced by running
  requests x block_size; held = sum of running requests' `num_tokens`; waste = 1 - held/allocated.
  The floor is what 16-token blocks force (every request in exactly ceil(num_tokens/16) blocks):
  the report sets the waste beside the floor's, and the allocated slots beyond the floor
  (1 - floor slots / allocated slots, 0 when no block is held that the floor would not hold).
  `num_tokens` of a request still in chunked prefill exceeds its allocated slots, so those steps
  understate waste; `waste_kv` (held = num_computed_tokens + tokens scheduled this step) is in
  the JSON too.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import hf_peer
from benchmarks.workload import Row, random_prompts
from engine import LLM, SamplingParams
from engine.worker.model_runner import RunnerOutput

TARGET_B = 10.0  # cached TTFT >= 10x faster than cold
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256


def load_llm(model_dir: Path, dtype: str, seed: int) -> LLM:
    return LLM(model=str(model_dir), dtype=dtype, seed=seed, max_num_seqs=MAX_NUM_SEQS,
               max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=True,
               block_size=BLOCK_SIZE)


def kv_generate(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int
                ) -> tuple[float, list[list[int]], list[Any]]:
    """(wall time, output ids, RequestOutputs) of one greedy generate call, EOS ignored."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                        use_tqdm=False)
    wall = time.perf_counter() - start
    return wall, [list(o.outputs[0].token_ids) for o in outs], outs


def scenario_b(llm: LLM, hf: Any, rng: random.Random, vocab: int, banned: set[int],
               args: argparse.Namespace) -> Row:
    prefix = random_prompts(rng, 1, 1024, 1024, vocab, banned)[0]

    def fresh() -> list[int]:
        return prefix + random_prompts(rng, 1, 16, 16, vocab, banned)[0]

    def ttft(prompt: list[int]) -> tuple[float, int]:
        wall, _, outs = kv_generate(llm, [prompt], 1)
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
    hf_s = None
    if hf is not None:
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


def scenario_c(llm: LLM, prompts: list[list[int]], output_len: int) -> Row:
    engine = llm.engine
    llm.reset_prefix_cache()
    # (waste by num_tokens, by KV written, the floor's waste, allocated slots beyond the floor)
    samples: list[tuple[float, float, float, float]] = []
    runner = engine.runner
    inner: Callable[..., RunnerOutput] = runner.execute
    bs = engine.kv.block_size

    def execute(scheduled: list[Any], block_ids: dict[str, list[int]]) -> RunnerOutput:
        new = {s.request.request_id: s.num_new_tokens for s in scheduled}
        running = engine.scheduler.running
        table = engine.kv.req_to_blocks
        blocks = {b.block_id for r in running for b in table.get(r.request_id, [])}
        slots = len(blocks) * bs
        if slots:
            held = sum(r.num_tokens for r in running)
            floor_slots = sum(-(-r.num_tokens // bs) * bs for r in running)
            written = sum(r.num_computed_tokens + new.get(r.request_id, 0) for r in running)
            samples.append((1 - held / slots, 1 - written / slots, 1 - held / floor_slots,
                            max(0.0, 1 - floor_slots / slots)))
        return inner(scheduled, block_ids)

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
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
    waste = [s[0] for s in samples]
    return {
        "steps": len(samples),
        "block_size": bs,
        "held_definition": "sum of running requests' num_tokens, sampled after scheduling",
        "waste_mean": statistics.fmean(waste),
        "waste_mean_time_weighted": sum(w * t for w, t in zip(waste, times, strict=True))
        / sum(times),
        "waste_max": max(waste),
        "waste_kv_mean": statistics.fmean(s[1] for s in samples),
        "waste_kv_max": max(s[1] for s in samples),
        "waste_floor_mean": statistics.fmean(s[2] for s in samples),
        "beyond_floor_mean": statistics.fmean(s[3] for s in samples),
        "beyond_floor_max": max(s[3] for s in samples),
    }
