"""Decode throughput of the default model's Q4_1 GGUF served directly vs kvfleet's dense model.

Systems (SmolLM2-135M-Instruct, one `LLM` each, loaded once): `gguf-q4_1` (the GGUF file,
weights kept quantized; engine.quant), `dense-float32` and `dense-bfloat16` (the converted
Hugging Face directory). For each batch size of `--batch-sizes` (1 and 32): that many prompts
of `--prompt-len` random ids, `--output-len` greedy tokens each (EOS ignored), queued
together; decode tokens/s = tokens after the first / the time of the steps after every
request's first token (prefill excluded). Best of `--repeats`. Prints a table and writes
bench_results/quant_bench.json (--out), with each system's weight bytes.

Usage: python -m benchmarks.quant_bench [--output-len 64] [--repeats 3]. A smoke run:
--output-len 8 --repeats 1 --batch-sizes 1.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams
from engine.models.default_model import gguf_path, prepare_default_model


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _decode_run(llm: LLM, prompts: list[list[int]], tokens: int, tag: str) -> float:
    """Seconds of the decode steps alone: the batch's requests are queued, stepped until
    every one has its first token (prefill), then timed until all are finished."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    requests = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def decode_tok_s(llm: LLM, batch: int, args: argparse.Namespace) -> float:
    """Best decode tokens/s over `args.repeats` rounds (new prompts each: no prefix hits)."""
    best = 0.0
    for r in range(args.repeats):
        prompts = _prompts(batch, args.prompt_len, 49152, seed=1000 * batch + r)
        seconds = _decode_run(llm, prompts, args.output_len, f"b{batch}-r{r}")
        best = max(best, batch * (args.output_len - 1) / seconds)
    return best


def systems() -> dict[str, dict[str, Any]]:
    dense = str(prepare_default_model())
    return {
        "gguf-q4_1": {"model": str(gguf_path()), "dtype": "float32"},
        "dense-float32": {"model": dense, "dtype": "float32"},
        "dense-bfloat16": {"model": dense, "dtype": "bfloat16"},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", nargs="+", default=None)
    parser.add_argument("--out", type=Path, default=Path("bench_results/quant_bench.json"))
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    for name, engine_args in systems().items():
        if args.systems and name not in args.systems:
            continue
        llm = LLM(max_model_len=args.prompt_len + args.output_len + 16, **engine_args)
        results[name] = {f"batch-{b}": decode_tok_s(llm, b, args) for b in args.batch_sizes}
        model = llm.engine.model
        results[name]["weight_MiB"] = getattr(model, "weight_bytes", sum(
            p.numel() * p.element_size() for p in model.parameters())) / 2**20
        del llm
    print(f"{'system':<16}" + "".join(f"{k:>14}" for k in next(iter(results.values()))))
    for name, row in results.items():
        print(f"{name:<16}" + "".join(f"{v:>14.1f}" for v in row.values()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                    "decode_tok_s": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
