"""Scenario A on a CUDA GPU: kvfleet (CUDA graphs and eager) beside transformers, same run.

The workload is scenario A's (32 random-id prompts of 16-256 tokens, 64 greedy tokens each,
EOS ignored), on SmolLM2-135M's architecture. When the converted SmolLM2 directory is at hand
(`--model`), its weights are used; otherwise (a GPU machine that cannot hold the checkpoint)
the same architecture and tokenizer files get seeded random weights (`--arch-from`): the
timing of a fixed-length greedy run does not depend on the weights' values, and the report
says which was measured. Rounds alternate systems; the report keeps every round and the
median. transformers runs the whole batch as one left-padded `generate` (its static-batch
baseline, no paged KV).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks.workload import random_prompts

NUM_PROMPTS = 32
NEW_TOKENS = 64
ROUNDS = 3
# Two engines live side by side, so each gets a fixed pool (the workload needs ~640 blocks)
# rather than a share of the GPU.
KV_BLOCKS = 2048


def random_weight_model(arch_dir: Path, dest: Path, seed: int = 0) -> Path:
    """`arch_dir`'s config and tokenizer with seeded random weights (std 0.02, as HF inits)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        if (arch_dir / name).is_file():
            shutil.copy(arch_dir / name, dest / name)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(dest)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest)
    return dest


def kvfleet_round(llm: Any, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def hf_round(model: Any, prompts: list[list[int]], pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                   min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad_id)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(model_dir: Path, dtype: str) -> dict[str, Any]:
    from engine import LLM

    config = transformers.AutoConfig.from_pretrained(model_dir)
    prompts = random_prompts(random.Random(0), NUM_PROMPTS, 16, 256, config.vocab_size, {0, 1, 2})
    gen_tokens = NUM_PROMPTS * NEW_TOKENS
    systems: dict[str, Any] = {
        "kvfleet (CUDA graphs)": LLM(str(model_dir), dtype=dtype, device="cuda",
                                     num_kv_blocks=KV_BLOCKS),
    }
    walls: dict[str, list[float]] = {name: [] for name in systems}
    walls["kvfleet (eager)"] = []
    walls["transformers generate"] = []
    eager = None
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).cuda().eval()
    tokens: list[list[int]] = []
    for round_ in range(ROUNDS + 1):  # round 0 warms up (Triton compiles), not counted
        wall, tokens = kvfleet_round(systems["kvfleet (CUDA graphs)"], prompts)
        if round_:
            walls["kvfleet (CUDA graphs)"].append(wall)
        if eager is None:
            eager = LLM(str(model_dir), dtype=dtype, device="cuda", enforce_eager=True,
                        num_kv_blocks=KV_BLOCKS)
        wall, eager_tokens = kvfleet_round(eager, prompts)
        if round_:
            walls["kvfleet (eager)"].append(wall)
        assert eager_tokens == tokens or dtype != "float32", "graphs and eager disagree"
        wall = hf_round(hf, prompts, config.pad_token_id or 0)
        if round_:
            walls["transformers generate"].append(wall)
    rows = {
        name: {"wall_s": statistics.median(w), "wall_samples_s": w,
               "gen_tok_s": gen_tokens / statistics.median(w)}
        for name, w in walls.items()
    }
    base = rows["transformers generate"]["gen_tok_s"]
    for row in rows.values():
        row["vs_transformers"] = row["gen_tok_s"] / base
    del systems, eager, hf
    gc.collect()
    torch.cuda.empty_cache()
    return {"dtype": dtype, "prompts": NUM_PROMPTS, "new_tokens": NEW_TOKENS, "systems": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=None, help="converted SmolLM2 directory")
    parser.add_argument("--arch-from", type=Path, default=None,
                        help="config + tokenizer directory for random weights")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/kvfleet-gpu-bench"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.model is not None:
        model_dir, weights = args.model, "checkpoint"
    elif args.arch_from is not None:
        model_dir = random_weight_model(args.arch_from, args.work_dir / "model")
        weights = "seeded random (architecture and tokenizer from --arch-from)"
    else:
        parser.error("give --model or --arch-from")
    report = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "weights": weights,
        "results": [measure(model_dir, dtype) for dtype in ("bfloat16", "float32")],
    }
    args.out.write_text(json.dumps(report, indent=2))
    for result in report["results"]:
        for name, row in result["systems"].items():
            print(f"{result['dtype']:>9} {name:<24} {row['gen_tok_s']:9.1f} gen tok/s "
                  f"({row['vs_transformers']:.2f}x transformers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
