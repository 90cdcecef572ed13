"""The time of a decode step outside its GEMMs, measured on a model whose GEMMs are tiny.

The model has SmolLM2-135M's decoder layout (30 layers, 9 query heads over 3 KV heads of
dimension 64, tied embeddings, its tokenizer) but a hidden size of 72 and an MLP of 144, with
random weights: its projections cost a few microseconds, so a step is what every Llama-path
decode step pays besides its GEMMs and LM head: per-layer Python glue, norms, RoPE, SiLU,
attention (same heads and context as the real model), scheduling, input building, sampling.
With two checkouts side by side (PYTHONPATH) it compares the glue of two versions, which the
real model's step, ~10x longer and mostly GEMM, cannot resolve on a shared machine.

Usage: python -m benchmarks.step_glue [--batch 1] [--steps 48] [--repeats 7] [--dtype
bfloat16]. One thread; prints each repeat's CPU ms a step (that thread's CPU seconds: a
descheduled slice on a loaded machine does not count).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams

PROMPT_LEN = 64


def build_glue_model(out_dir: Path) -> Path:
    """The small-GEMM SmolLM2-shaped checkpoint in `out_dir` (seeded random weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.models.default_model import prepare_default_model

    source = prepare_default_model()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out_dir / name)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=72, intermediate_size=144, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
        bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(out_dir))
    return out_dir


def step_ms(llm: LLM, batch: int, steps: int, seed: int) -> float:
    """CPU ms a decode step of `batch` requests, over `steps` steps after their prefill."""
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    requests = [
        engine.add_request(f"g{seed}-{i}", [rng.randrange(100, 49000) for _ in range(PROMPT_LEN)],
                           params)
        for i in range(batch)
    ]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    start = time.thread_time()
    for _ in range(steps):
        engine.step()
    seconds = time.thread_time() - start
    while engine.has_unfinished_requests():
        engine.step()
    return seconds * 1e3 / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_glue_model(Path(tmp) / "glue_model")
        llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=PROMPT_LEN + args.steps + 32)
        step_ms(llm, args.batch, args.steps, seed=0)  # warm-up: first-call costs
        times = [step_ms(llm, args.batch, args.steps, seed) for seed in range(1, args.repeats + 1)]
    ordered = sorted(times)
    print(f"batch {args.batch} {args.dtype}: ms a step " + " ".join(f"{t:.3f}" for t in times)
          + f" (median {ordered[len(ordered) // 2]:.3f})")


if __name__ == "__main__":
    main()
