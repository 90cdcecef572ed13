"""Decode throughput of the default model's Q4_1 GGUF served directly (and of int8 weights at
load) vs kvfleet's dense model, plus offline scenario A.

Systems (SmolLM2-135M-Instruct, one `LLM` each, loaded once): `gguf-q4_1-f32` and
`gguf-q4_1-bf16` (the GGUF file, weights kept quantized, activations float32 / bfloat16;
engine.quant), `int8-bf16` (the dense directory with `quantization="int8"`), `dense-float32`
and `dense-bfloat16` (the Hugging Face directory converted from the GGUF). For each batch size
of `--batch-sizes` (1 and 32): that many prompts of `--prompt-len` random ids,
`--output-len` greedy tokens each (EOS ignored), queued together; decode tokens/s = tokens
after the first / the time of the steps after every request's first token (prefill
excluded). Best of `--repeats`. `--scenario-a`: also scenario A of benchmarks.offline_throughput
(32 random-id prompts of 16-256 tokens, 64 greedy tokens each, one generate call, prefill
included, prefix cache reset), generated tokens/s, best of `--repeats`. Prints a table and
writes bench_results/quant_bench.json (--out), with each system's weight bytes and the
ratio of every figure to dense-bfloat16's.

`--threads 1 --clock cpu` times by the process's CPU seconds on one thread: on a machine
shared with other jobs, wall time charges every descheduled slice (with two OpenMP threads,
every parallel region waits on the descheduled one), CPU time does not.

Usage: python -m benchmarks.quant_bench [--output-len 64] [--repeats 3] [--scenario-a]
[--threads 1 --clock cpu]. A smoke run: --output-len 8 --repeats 1 --batch-sizes 1.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.kvfleet_runner import kv_generate
from benchmarks.workload import PROMPT_LEN_RANGE, random_prompts
from engine import LLM, SamplingParams
from engine.models.default_model import gguf_path, prepare_default_model

BASELINE = "dense-bfloat16"
VOCAB = 49152


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB - 100) for _ in range(length)] for _ in range(n)]


_CLOCK: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _decode_run(llm: LLM, prompts: list[list[int]], tokens: int, tag: str) -> float:
    """Seconds of the decode steps alone: the batch's requests are queued, stepped until
    every one has its first token (prefill), then timed until all are finished."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    requests = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    start = _clock()
    while engine.has_unfinished_requests():
        engine.step()
    return _clock() - start


def decode_tok_s(llm: LLM, batch: int, args: argparse.Namespace) -> float:
    """Best decode tokens/s over `args.repeats` rounds (new prompts each: no prefix hits)."""
    best = 0.0
    for r in range(args.repeats):
        prompts = _prompts(batch, args.prompt_len, seed=1000 * batch + r)
        seconds = _decode_run(llm, prompts, args.output_len, f"b{batch}-r{r}")
        best = max(best, batch * (args.output_len - 1) / seconds)
    return best


def scenario_a_tok_s(llm: LLM, args: argparse.Namespace) -> float:
    """Scenario A's generated tokens/s (prefill included), best of `args.repeats`."""
    rng = random.Random(0)
    prompts = random_prompts(rng, 32, *PROMPT_LEN_RANGE, VOCAB, set())
    kv_generate(llm, random_prompts(rng, 2, *PROMPT_LEN_RANGE, VOCAB, set()), 4)  # warm-up
    best = 0.0
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        start = _clock()
        _, outs, _ = kv_generate(llm, prompts, 64)
        best = max(best, sum(len(o) for o in outs) / (_clock() - start))
    return best


def systems() -> dict[str, dict[str, Any]]:
    dense = str(prepare_default_model())
    gguf = str(gguf_path())
    return {
        "gguf-q4_1-f32": {"model": gguf, "dtype": "float32"},
        "gguf-q4_1-bf16": {"model": gguf, "dtype": "bfloat16"},
        "int8-bf16": {"model": dense, "dtype": "bfloat16", "quantization": "int8"},
        "dense-float32": {"model": dense, "dtype": "float32"},
        BASELINE: {"model": dense, "dtype": "bfloat16"},
    }


def measure(engine_args: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    llm = LLM(max_model_len=max(args.prompt_len + args.output_len, 256 + 64) + 16,
              **engine_args)
    row = {f"batch-{b}": decode_tok_s(llm, b, args) for b in args.batch_sizes}
    if args.scenario_a:
        row["scenario-A"] = scenario_a_tok_s(llm, args)
    model = llm.engine.model
    row["weight_MiB"] = getattr(model, "weight_bytes", sum(
        p.numel() * p.element_size() for p in model.parameters())) / 2**20
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenario-a", action="store_true")
    parser.add_argument("--systems", nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--clock", choices=sorted(_CLOCK), default="wall",
                        help="cpu: the process's CPU seconds (with --threads 1, a machine "
                             "shared with other jobs does not count its descheduled time)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/quant_bench.json"))
    args = parser.parse_args(argv)
    global _clock
    _clock = _CLOCK[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {name: measure(engine_args, args) for name, engine_args in systems().items()
               if not args.systems or name in args.systems}
    base = results.get(BASELINE)
    ratios = {name: {k: v / base[k] for k, v in row.items() if k != "weight_MiB"}
              for name, row in results.items()} if base else {}
    print(f"{'system':<16}" + "".join(f"{k:>14}" for k in next(iter(results.values()))))
    for name, row in results.items():
        cells = [f"{v:>8.1f}" + (f" {ratios[name][k]:4.2f}x" if k in ratios.get(name, {}) else
                                  " " * 6) for k, v in row.items()]
        print(f"{name:<16}" + "".join(cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                    "tok_s": results, "vs_" + BASELINE: ratios}, indent=2) + "\n")


if __name__ == "__main__":
    main()
