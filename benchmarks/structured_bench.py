"""Structured outputs' overhead: decode time per output token with a grammar vs without.

One `LLM` (the default model, `--dtype`), loaded once. For each batch size of
`--batch-sizes` (1, 8, 32), that many prompts of `--prompt-len` random ids, `--output-len`
greedy tokens each (EOS ignored), queued together, in three modes: `none` (no constraint),
`permissive` (a grammar allowing every token: the mask is computed each step, and a row whose
mask allows everything skips the masking; the tokens are those of `none`) and `words` (a regex
of lowercase words: a real lexer's mask every step; tokens differ, so its figure says what a
real constraint costs, not a like-for-like ratio). TPOT = the mean time of the steps in which
the whole batch decodes (every request past its first token, none finished). Modes alternate
within each repeat and the best of `--repeats` counts, so a busy neighbour hurts all alike.
Prints a table with the ratios to `none` (targets for permissive: <= 1.05 at batch 1, <= 1.10
at 32), the engine's mask-fill and compile times, and writes
bench_results/structured_bench.json (--out).

Usage: python -m benchmarks.structured_bench [--repeats 3] [--output-len 48].
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.models.default_model import prepare_default_model

PERMISSIVE = StructuredOutputsParams(grammar="start: <[*]>*")
# A grammar with a lexer that goes on for the whole output (a JSON object closes within a few
# tokens, and a finished row leaves the batch).
WORDS = StructuredOutputsParams(regex=r"[a-z]+( [a-z]+)*")
MODES = {"none": None, "permissive": PERMISSIVE, "words": WORDS}


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def tpot_s(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> float:
    """Seconds per decode step while the whole batch decodes (every request past its first
    token, none finished): one output token per request per step."""
    engine = llm.engine
    requests = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    steps, elapsed = 0, 0.0
    while not any(r.status.finished for r in requests):
        start = time.perf_counter()
        engine.step()
        elapsed += time.perf_counter() - start
        steps += 1
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps if steps else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("bench_results/structured_bench.json"))
    args = parser.parse_args(argv)
    llm = LLM(str(prepare_default_model()), dtype=args.dtype,
              max_model_len=args.prompt_len + args.output_len + 16)
    results: dict[str, dict[str, float]] = {}
    for batch in args.batch_sizes:
        best = {mode: float("inf") for mode in MODES}
        for r in range(args.repeats):
            prompts = _prompts(batch, args.prompt_len, seed=1000 * batch + r)
            for mode, constraint in MODES.items():
                params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                        ignore_eos=True,
                                        structured_outputs=constraint)
                best[mode] = min(best[mode], tpot_s(llm, prompts, params, f"{mode}-{batch}-{r}"))
        results[f"batch-{batch}"] = {f"{m}_tpot_ms": 1000 * s for m, s in best.items()} | {
            "permissive_over_none": best["permissive"] / best["none"],
            "words_over_none": best["words"] / best["none"]}
    compile_s, mask_s = llm.engine.structured.take_observations()
    masks = {"mask_us_p50": 1e6 * percentile(mask_s, 0.5),
             "mask_us_p99": 1e6 * percentile(mask_s, 0.99),
             "compile_ms_p50": 1e3 * percentile(compile_s, 0.5),
             "compile_ms_max": 1e3 * max(compile_s, default=0.0),
             "mask_steps": float(len(mask_s)),
             "mean_mask_us": 1e6 * statistics.fmean(mask_s) if mask_s else 0.0}
    print(f"{'batch':<10}{'none ms':>10}{'permissive':>12}{'words':>10}{'perm/none':>11}"
          f"{'words/none':>11}")
    for name, row in results.items():
        print(f"{name:<10}{row['none_tpot_ms']:>10.2f}{row['permissive_tpot_ms']:>12.2f}"
              f"{row['words_tpot_ms']:>10.2f}{row['permissive_over_none']:>11.3f}"
              f"{row['words_over_none']:>11.3f}")
    print("mask fill (per step, all constrained rows): "
          f"p50 {masks['mask_us_p50']:.0f} us, p99 {masks['mask_us_p99']:.0f} us; "
          f"compile p50 {masks['compile_ms_p50']:.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                    "tpot": results, "grammar": masks}, indent=2) + "\n")


if __name__ == "__main__":
    main()
