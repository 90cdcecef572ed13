"""Scenarios E and F judge their targets from the measured rows (benchmarks/spec_decode.py,
benchmarks/lora_bench.py): exact ratios and PASS/MISS on made-up figures, vLLM's plain decoding
standing in when it refuses speculation, and a report that prints from the result dict alone.
"""

from __future__ import annotations

from typing import Any

from benchmarks import lora_bench, spec_decode

FACTS: dict[str, Any] = {
    "config": {"dtype": "float32"},
    "cpu": {"model_name": "Test CPU", "logical_cpus": 2, "isa": {"avx512f": True}},
    "kvfleet_facts": {"torch": "2.x", "threads": 2, "allocator": "glibc malloc"},
    "vllm_facts": {},
    "vllm_compiled": False,
    "total_run_s": 1.0,
    "loadavg_before": [0.0, 0.0, 0.0],
    "loadavg_after": [0.0, 0.0, 0.0],
}


def spec_row(tok_s: float, **extra: float) -> dict[str, Any]:
    return {"tok_s": tok_s, "outputs": [[1, 2, 3]], **extra}


def spec_results(vllm_ngram: dict[str, Any]) -> dict[str, Any]:
    systems = {
        "kvfleet": {"grounded": spec_row(50.0), "random": spec_row(40.0)},
        "kvfleet ngram": {
            "grounded": spec_row(100.0, acceptance_rate=0.6, mean_accepted_per_draft=2.0),
            "random": spec_row(36.0, acceptance_rate=0.1, mean_accepted_per_draft=0.2),
        },
        "vLLM": {"grounded": spec_row(40.0), "random": spec_row(40.0)},
        "vLLM ngram": vllm_ngram,
    }
    workloads = {
        "grounded": {"num_prompts": 1, "max_tokens": 16},
        "random": {"num_prompts": 1, "max_tokens": 16},
    }
    results = {**FACTS, "systems": systems, "workloads": workloads, "rounds": 1}
    results["targets"] = spec_decode.check_targets(systems)
    return results


def test_spec_targets_compare_with_vllm_ngram() -> None:
    results = spec_results({"grounded": spec_row(80.0), "random": spec_row(40.0)})
    assert [(t["label"], t["ratio"], t["pass"]) for t in results["targets"]] == [
        ("E grounded: kvfleet ngram / kvfleet plain", 2.0, True),
        ("E grounded: kvfleet ngram / vLLM ngram", 1.25, True),
        ("E random: kvfleet ngram / kvfleet plain", 0.9, False),
    ]
    text = "\n".join(spec_decode.print_report(results))
    assert "E random: kvfleet ngram / kvfleet plain 0.90x (>= 0.95x): MISS" in text
    assert "greedy tokens: kvfleet ngram == kvfleet for 2/2 prompts" in text


def test_spec_targets_fall_back_to_vllm_plain_when_it_refuses_speculation() -> None:
    results = spec_results({"error": "speculative decoding is not supported on CPU"})
    second = results["targets"][1]
    assert (second["label"], second["ratio"]) == ("E grounded: kvfleet ngram / vLLM", 2.5)
    text = "\n".join(spec_decode.print_report(results))
    assert "vLLM ngram: refused: speculative decoding is not supported on CPU" in text


def lora_modes(base: float, mixed: float) -> dict[str, Any]:
    return {lora_bench.BASE: {"gen_tok_s": base}, lora_bench.MIXED: {"gen_tok_s": mixed}}


def test_lora_targets_and_report() -> None:
    rows = {"kvfleet": lora_modes(200.0, 140.0), "vLLM": lora_modes(100.0, 100.0)}
    results = {
        **FACTS,
        "systems": rows,
        "errors": {},
        "adapters": 8,
        "rank": 16,
        "num_prompts": 8,
        "output_len": 8,
        "rounds": 1,
    }
    results["targets"] = lora_bench.check_targets(rows)
    assert [(t["ratio"], t["pass"]) for t in results["targets"]] == [(0.7, False), (1.4, True)]
    text = "\n".join(lora_bench.print_report(results))
    assert "F kvfleet 8 adapters / kvfleet base 0.70x (>= 0.75x): MISS" in text
    assert "F kvfleet / vLLM with 8 adapters 1.40x (>= 1.1x): PASS" in text
    assert "kvfleet / vLLM" in text and "2.00x" in text  # the base-model ratio column
