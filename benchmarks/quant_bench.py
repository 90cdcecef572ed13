"""Decode throughput of the default model's Q4_1 GGUF served directly vs kvfleet's dense model.

Systems (SmolLM2-135M-Instruct, one `LLM` each, loaded once): `gguf-q4_1` (the GGUF file,
weights kept quantized; engine.quant), `dense-float32` and `dense-bfloat16` (the converted
Hugging Face directory). For each batch size of `--batch-sizes` (1 and 32): that many prompts
of `--prompt-len` random ids, `--output-len` greedy tokens each (EOS ignored); decode tokens/s
= generated tokens / (wall time - the time of a 1-token run of the same batch, i.e. prefill).
Best of `--repeats`. Prints a table and writes bench_results/quant_bench.json (--out), with
each system's weight bytes as the start-up log reports them for the GGUF.

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


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]}
            for _ in range(n)]


def _wall(llm: LLM, prompts: list[dict[str, Any]], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def decode_tok_s(llm: LLM, batch: int, args: argparse.Namespace) -> float:
    best = 0.0
    for r in range(args.repeats):
        # New prompts per round: no prefix hits between rounds.
        prompts = _prompts(batch, args.prompt_len, 49152, seed=1000 * batch + r)
        prefill = _wall(llm, prompts, 1)
        prompts = _prompts(batch, args.prompt_len, 49152, seed=1000 * batch + r + 500)
        total = _wall(llm, prompts, args.output_len)
        decode = max(total - prefill, 1e-9)
        best = max(best, batch * (args.output_len - 1) / decode)
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
