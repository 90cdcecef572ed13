"""Accuracy of the load-time quantizations (`quantization="int8"` and `"int4"`) against the
unquantized model: reported, not gated (issue 40).

Model: the default model's dense directory (SmolLM2-135M-Instruct, float32), or `--model DIR`.
Prompts: `PROMPTS`, a fixed set of chat questions under the model's own chat template.
For each method, in float32 (so the figures measure the weights' rounding only):

- **greedy agreement**: each prompt's `--output-len` greedy tokens from `LLM(quantization=...)`
  against the unquantized `LLM`'s: the share of positions whose tokens are equal, the share of
  tokens before each prompt's first divergence, and the prompts identical throughout;
- **mean KL**: KL(P_dense || P_quant) of the next-token distributions, averaged over every
  position of the dense model's greedy continuations (teacher-forced: both models read the
  same tokens). Both distributions come from transformers' forward, the quantized one with
  the quantized model's projections as dequantized (`QuantLinear.dequantized_weight`, split
  back into q/k/v and gate/up), which is the model kvfleet serves: in float32 kvfleet's
  greedy output equals transformers' on the same weights.

Usage: python -m benchmarks.quant_accuracy [--methods int8 int4] [--output-len 32]
Writes bench_results/quant_accuracy.json (--out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import transformers

from engine import LLM, SamplingParams
from engine.models.default_model import prepare_default_model
from engine.quant.qlinear import QuantLinear

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 10.",
    "How do I reverse a list in Python?",
    "Give me a short tip for staying focused.",
    "What does a CPU cache do?",
    "Translate 'good morning' into Spanish.",
)


def chat_prompts(model_dir: Path) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                     add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    return [list(tok.encode(t, add_special_tokens=False)) for t in texts]


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(want: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    total = sum(len(w) for w in want)
    equal = sum(a == b for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    prefix = 0
    for w, g in zip(want, got, strict=True):
        prefix += next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), len(w))
    return {"positions_equal": equal / total, "before_first_divergence": prefix / total,
            "prompts_identical": sum(w == g for w, g in zip(want, got, strict=True)) / len(want)}


@torch.no_grad()
def load_quantized_weights(hf: Any, llm: LLM) -> None:
    """Overwrite transformers' projections with `llm`'s quantized ones, dequantized."""
    config = llm.engine.model.config
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    for ours, theirs in zip(llm.engine.model.layers, hf.model.layers, strict=True):
        attn, mlp = ours.self_attn, ours.mlp
        assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(mlp.gate_up_proj, QuantLinear)
        q, k, v = attn.qkv_proj.dequantized_weight().split([q_rows, kv_rows, kv_rows])
        gate, up = mlp.gate_up_proj.dequantized_weight().chunk(2)
        pairs = [(theirs.self_attn.q_proj, q), (theirs.self_attn.k_proj, k),
                 (theirs.self_attn.v_proj, v), (theirs.mlp.gate_proj, gate),
                 (theirs.mlp.up_proj, up),
                 (theirs.self_attn.o_proj, attn.o_proj.dequantized_weight()),
                 (theirs.mlp.down_proj, mlp.down_proj.dequantized_weight())]
        for linear, weight in pairs:
            linear.weight.copy_(weight)


@torch.no_grad()
def log_probs(hf: Any, prompts: list[list[int]], outputs: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: log-softmax [output_len, vocab] of the positions predicting each output."""
    result = []
    for p, o in zip(prompts, outputs, strict=True):
        ids = torch.tensor([p + o])
        logits = hf(input_ids=ids).logits[0, len(p) - 1:len(p) + len(o) - 1].float()
        result.append(torch.log_softmax(logits, dim=-1))
    return result


def mean_kl(dense: list[torch.Tensor], quant: list[torch.Tensor]) -> float:
    kls = [(d.exp() * (d - q)).sum(-1) for d, q in zip(dense, quant, strict=True)]
    return float(torch.cat(kls).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Hugging Face directory (default model)")
    parser.add_argument("--methods", nargs="+", default=["int8", "int4"])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", default="bench_results/quant_accuracy.json")
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else prepare_default_model()
    prompts = chat_prompts(model_dir)
    dense_out = greedy(LLM(str(model_dir), dtype="float32"), prompts, args.output_len)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dense_lp = log_probs(hf, prompts, dense_out)
    results: dict[str, Any] = {"model": str(model_dir), "prompts": len(prompts),
                               "output_len": args.output_len, "methods": {}}
    for method in args.methods:
        llm = LLM(str(model_dir), dtype="float32", quantization=method)
        row = agreement(dense_out, greedy(llm, prompts, args.output_len))
        load_quantized_weights(hf, llm)
        row["mean_kl"] = mean_kl(dense_lp, log_probs(hf, prompts, dense_out))
        results["methods"][method] = row
        print(f"{method}: positions equal {row['positions_equal']:.3f}, before first divergence "
              f"{row['before_first_divergence']:.3f}, prompts identical "
              f"{row['prompts_identical']:.3f}, mean KL {row['mean_kl']:.5f} nats", flush=True)
        del llm
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
