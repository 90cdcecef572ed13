"""Scenario E: speculative decoding, single-stream latency, kvfleet beside vLLM-CPU.

Workloads (one request at a time, greedy, EOS ignored, prefix cache reset before each):
- grounded: "rewrite this passage with small edits" chat prompts built from paragraphs of
  docs/architecture.md (shipped with the repository), 192 tokens out: the output reuses the
  prompt's n-grams, where prompt-lookup drafting pays;
- random: scenario A's random-id prompts, 64 tokens out: speculation must cost at most 5%.

Systems: kvfleet without speculation, with n-gram drafting, and with a draft model (SmolLM2's
first DRAFT_LAYERS layers, built once under the bench directory); vLLM-CPU without and with
its n-gram drafting, in its own worker process. Reported per system and workload: tokens/s of
one stream (median over prompts x rounds), and for speculative systems the acceptance rate
(accepted / drafted tokens) and mean accepted length per draft. Targets: kvfleet n-gram
>= 1.8x kvfleet plain on the grounded workload, >= 1.1x vLLM's n-gram there, and >= 0.95x
plain on the random workload.
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

from benchmarks.vllm_runner import PeerConfig, PeerError, VllmWorker
from benchmarks.workload import random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
DRAFT_LAYERS = 8
GROUNDED_OUT = 192
RANDOM_OUT = 64
TARGET_GROUNDED = 1.8
TARGET_VLLM = 1.1
TARGET_RANDOM = 0.95
Generate = Callable[[list[int], int], tuple[float, list[int]]]


def grounded_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    paragraphs = [p.strip() for p in text.split("\n\n")
                  if 300 <= len(p.strip()) <= 900 and not p.lstrip().startswith(("#", "|"))]
    prompts = []
    for paragraph in paragraphs[:count]:
        messages = [{"role": "user", "content": "Rewrite this passage with small edits, "
                     "keeping its wording where you can:\n\n" + paragraph}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
    return prompts


def truncated_draft(model_dir: Path, dest: Path, layers: int) -> Path:
    """SmolLM2 cut to its first `layers` layers (same tokenizer): the draft the machine has."""
    if (dest / "model.safetensors").is_file():
        return dest
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, dest / name)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(model_dir / "model.safetensors"))
    kept = {k: v for k, v in tensors.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(kept, str(dest / "model.safetensors"))
    return dest


def kvfleet_system(model_dir: Path, dtype: str, spec: dict[str, Any] | None
                   ) -> tuple[Generate, Callable[[], dict[str, float]]]:
    from engine import LLM, SamplingParams

    extra = {} if spec is None else {"speculative_config": spec}
    llm = LLM(str(model_dir), dtype=dtype, seed=0, **extra)

    def generate(prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        return time.perf_counter() - start, list(out.outputs[0].token_ids)

    def counters() -> dict[str, float]:
        stats = llm.get_stats()
        return {k: float(v) for k, v in stats.items()
                if k.startswith("spec_decode") and isinstance(v, (int, float))}

    return generate, counters


def measure(generate: Generate, counters: Callable[[], dict[str, float]],
            prompts: Sequence[list[int]], max_tokens: int, rounds: int) -> dict[str, Any]:
    generate(prompts[0], 8)  # warm-up
    before = counters()
    rates, outputs = [], []
    for _ in range(rounds):
        for prompt in prompts:
            wall, out = generate(prompt, max_tokens)
            rates.append(len(out) / wall)
            outputs.append(out)
    after = counters()
    row: dict[str, Any] = {"tok_s": statistics.median(rates), "tok_s_samples": rates,
                           "outputs": outputs[: len(prompts)]}
    drafted = _delta(after, before, "num_draft_tokens")
    if drafted:
        accepted = _delta(after, before, "num_accepted_tokens")
        drafts = _delta(after, before, "num_drafts")
        row.update(acceptance_rate=accepted / drafted,
                   mean_accepted_per_draft=accepted / drafts if drafts else None)
    return row


def _delta(after: dict[str, float], before: dict[str, float], suffix: str) -> float:
    def pick(d: dict[str, float]) -> float:
        return sum(v for k, v in d.items() if k.endswith(suffix) and "per_pos" not in k)

    return pick(after) - pick(before)


def vllm_system(worker: VllmWorker) -> tuple[Generate, Callable[[], dict[str, float]]]:
    def generate(prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        wall, outs = worker.generate([prompt], max_tokens)
        return wall, outs[0]

    return generate, lambda: dict(getattr(worker, "last_spec_counters", {}))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.default_model import prepare_default_model
    from engine.tokenizer import Tokenizer

    model_dir = Path(args.model) if args.model else prepare_default_model()
    tokenizer = Tokenizer.from_dir(model_dir)
    workloads = {
        "grounded": (grounded_prompts(tokenizer, args.num_prompts), GROUNDED_OUT),
        "random": (random_prompts(random.Random(0), args.num_prompts, 16, 256,
                                  tokenizer.vocab_size, {0, 1, 2}), RANDOM_OUT),
    }
    draft = truncated_draft(model_dir, Path(args.work_dir) / "draft", DRAFT_LAYERS)
    systems: dict[str, Any] = {
        "kvfleet": None,
        "kvfleet ngram": NGRAM,
        f"kvfleet draft ({DRAFT_LAYERS} layers)": {
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
    }
    results: dict[str, Any] = {"model": str(model_dir), "dtype": args.dtype, "systems": {}}
    for name, spec in systems.items():
        gen, counters = kvfleet_system(model_dir, args.dtype, spec)
        results["systems"][name] = {w: measure(gen, counters, p, n, args.rounds)
                                    for w, (p, n) in workloads.items()}
    if "vllm" in args.peers:
        cfg = PeerConfig(cache_dir=Path(args.work_dir) / "peer-cache")
        for name, extra in (("vLLM", ()), ("vLLM ngram",
                                            ("--speculative-config", json.dumps(NGRAM)))):
            try:
                with VllmWorker(model_dir, args.dtype, cfg, Path(args.work_dir) / f"{name}.log",
                                seed=0, max_num_seqs=256, max_num_batched_tokens=2048,
                                extra_args=extra) as worker:
                    gen, counters = vllm_system(worker)
                    results["systems"][name] = {w: measure(gen, counters, p, n, args.rounds)
                                                for w, (p, n) in workloads.items()}
            except PeerError as exc:
                results["systems"][name] = {"error": str(exc)[:2000]}
    return results


def report(results: dict[str, Any]) -> list[str]:
    systems = results["systems"]
    lines = [f"== E. speculative decoding, one stream ({results['dtype']})"]
    for name, rows in systems.items():
        if "error" in rows:
            lines.append(f"{name:<28} refused: {rows['error'].splitlines()[0][:120]}")
            continue
        for workload, row in rows.items():
            extra = ""
            if "acceptance_rate" in row:
                extra = (f"  acceptance {row['acceptance_rate']:.2f}, mean accepted/draft "
                         f"{row['mean_accepted_per_draft'] or 0:.2f}")
            lines.append(f"{name:<28} {workload:<9} {row['tok_s']:7.1f} tok/s{extra}")

    def rate(system: str, workload: str) -> float | None:
        row = systems.get(system, {}).get(workload)
        return None if not isinstance(row, dict) else row["tok_s"]

    for name, rows in systems.items():  # greedy speculation must not change a token
        if name.startswith("kvfleet ") and "error" not in rows:
            same = all(rows[w]["outputs"] == systems["kvfleet"][w]["outputs"] for w in rows)
            lines.append(f"{name}: tokens {'equal' if same else 'DIFFER from'} plain decoding's")
    plain, ngram = rate("kvfleet", "grounded"), rate("kvfleet ngram", "grounded")
    if plain and ngram:
        r = ngram / plain
        lines.append(f"E grounded: kvfleet ngram / plain {r:.2f}x (>= {TARGET_GROUNDED}x): "
                     f"{'PASS' if r >= TARGET_GROUNDED else 'MISS'}")
    peer_name = "vLLM ngram" if rate("vLLM ngram", "grounded") else "vLLM"
    peer = rate(peer_name, "grounded")
    if ngram and peer:
        r = ngram / peer
        lines.append(f"E grounded: kvfleet ngram / {peer_name} {r:.2f}x (>= {TARGET_VLLM}x): "
                     f"{'PASS' if r >= TARGET_VLLM else 'MISS'}")
    plain_r, ngram_r = rate("kvfleet", "random"), rate("kvfleet ngram", "random")
    if plain_r and ngram_r:
        r = ngram_r / plain_r
        lines.append(f"E random: kvfleet ngram / plain {r:.2f}x (>= {TARGET_RANDOM}x): "
                     f"{'PASS' if r >= TARGET_RANDOM else 'MISS'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--peers", default="vllm", help="vllm, or none")
    p.add_argument("--work-dir", default="bench_results/spec_decode")
    p.add_argument("--out", default="bench_results/spec_decode.json")
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
