"""Bench scenario E (standalone for now): single-stream speed with speculative decoding.

SmolLM2-135M-Instruct, one request at a time, greedy, float32 unless --dtype. Workloads:
- grounded: chat prompts asking to rewrite a passage with small edits, the passage taken from
  this repository's README.md (a shipped text), where n-gram lookup finds what comes next;
- random: scenario A's prompts (random ids, lengths 16-256), where it should not pay.
Systems: plain decoding; ngram (k, lookup 2-4); draft_model with a layer-truncated copy of
SmolLM2 as the draft (--draft-layers of its 30). For each: single-stream generated tokens/s
(median over --repeats rounds of all prompts, each a separate request), acceptance rate, mean
accepted length (1 + kept drafts per verifying step) and whether the tokens equal plain
decoding's. Timings on a shared machine are noisy; the load average is recorded.
Results go to bench_results/spec_decode.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from benchmarks.workload import random_prompts
from engine import LLM, SamplingParams
from engine.default_model import prepare_default_model

NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def truncated_draft(model_dir: Path, num_layers: int, out_dir: Path) -> Path:
    """A copy of the model keeping its first `num_layers` decoder layers (same vocabulary)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            (out_dir / item.name).write_bytes(item.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    weights: dict[str, Any] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            weights[name] = tensor
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def grounded_prompts(llm: LLM, count: int) -> list[list[int]]:
    text = Path("README.md").read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if 300 <= len(p) <= 900 and "|" not in p]
    prompts = []
    for passage in paragraphs[:count]:
        messages = [
            {
                "role": "user",
                "content": "Rewrite this passage, fixing any typos and "
                "changing as little as possible:\n\n" + passage,
            }
        ]
        template = llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(llm.engine.tokenizer.encode(template, add_special_tokens=False))
    return prompts


def measure(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, repeats: int
) -> tuple[float, list[list[int]]]:
    walls: list[float] = []
    outs: list[list[int]] = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        outs, wall, tokens = [], 0.0, 0
        for ids in prompts:  # one stream at a time
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            wall += time.perf_counter() - start
            outs.append(out.outputs[0].token_ids)
            tokens += len(outs[-1])
        walls.append(tokens / wall)
    return statistics.median(walls), outs


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = prepare_default_model()
    draft_dir = truncated_draft(
        model_dir, args.draft_layers, Path(args.cache) / f"SmolLM2-135M-{args.draft_layers}layers"
    )
    systems: dict[str, dict[str, Any] | None] = {
        "plain": None,
        f"ngram-k{args.k}": {**NGRAM, "num_speculative_tokens": args.k},
        f"draft-{args.draft_layers}l-k{args.k}": {
            "method": "draft_model",
            "model": str(draft_dir),
            "num_speculative_tokens": args.k,
        },
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    prompts: dict[str, list[list[int]]] = {}
    baseline: dict[str, list[list[int]]] = {}
    for name, spec in systems.items():
        llm = LLM(str(model_dir), dtype=args.dtype, speculative_config=spec)
        if not prompts:
            vocab = llm.engine.model_config.vocab_size
            prompts["grounded"] = grounded_prompts(llm, args.num_prompts)
            prompts["random"] = random_prompts(
                random.Random(0), args.num_prompts, 16, 256, vocab, set()
            )
        llm.generate(
            [{"prompt_token_ids": prompts["random"][0]}],
            SamplingParams(max_tokens=4),
            use_tqdm=False,
        )  # warm-up
        for workload, items in prompts.items():
            before = dict(llm.get_stats())
            tok_s, outs = measure(llm, items, params, args.repeats)
            stats = llm.get_stats()
            drafts = stats.get("spec_decode_num_drafts", 0) - before.get(
                "spec_decode_num_drafts", 0
            )
            draft_tokens = stats.get("spec_decode_num_draft_tokens", 0) - before.get(
                "spec_decode_num_draft_tokens", 0
            )
            kept = stats.get("spec_decode_num_accepted_tokens", 0) - before.get(
                "spec_decode_num_accepted_tokens", 0
            )
            if name == "plain":
                baseline[workload] = outs
            row = {
                "system": name,
                "workload": workload,
                "gen_tok_s": tok_s,
                "speedup": None,
                "acceptance_rate": kept / draft_tokens if draft_tokens else None,
                "mean_accepted_length": 1 + kept / drafts if drafts else None,
                "equal_to_plain": outs == baseline[workload],
            }
            rows.append(row)
            print(row, flush=True)
    for row in rows:
        plain = next(r for r in rows if r["system"] == "plain" and r["workload"] == row["workload"])
        row["speedup"] = row["gen_tok_s"] / plain["gen_tok_s"]
    return {"rows": rows, "load_average": os.getloadavg(), "args": vars(args)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "kvfleet" / "models"))
    parser.add_argument("--out", default="bench_results/spec_decode.json")
    args = parser.parse_args()
    result = run(args)
    for row in result["rows"]:
        print(
            f"{row['workload']:9s} {row['system']:16s} {row['gen_tok_s']:7.1f} tok/s "
            f"x{row['speedup']:.2f}  acceptance {row['acceptance_rate']}  "
            f"mean accepted length {row['mean_accepted_length']}  "
            f"equal {row['equal_to_plain']}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
