"""Whether a screened greedy argmax could skip most of the default GGUF's Q8_0 LM head: the
rigorous error bound of the cheapest proxy against the logit gaps it would have to resolve.

The proxy reads each weight's high nibble only (a Q8_0 integer q = 16 h + l, l in 0..15 taken
as 7.5), half the head's quantized bytes; then for every token n, |exact_n - proxy_n| <=
7.5 * sum_b d_{n,b} * ||x_b||_1 (x the final hidden state, b its 32-element blocks). A screen
keeps every token whose proxy + bound reaches the largest proxy - bound; the exact logits of
the kept tokens decide. Per prompt this prints the top-1/top-2 gap of the exact logits, the
median bound and how many tokens the screen would keep; the bound is checked to hold on every
token. Float32, the Hugging Face directory's final hidden state (after the final norm) at the
prompt's last position, the GGUF file's `token_embd` blocks.

`python -m benchmarks.quant_head_screen`
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.models.default_model import gguf_path, prepare_default_model

PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away,", "Explain quantum computing in simple terms.")
Q8_0 = 8


def head_blocks() -> tuple[torch.Tensor, torch.Tensor]:
    """The Q8_0 head's scales [V, nb] (float32) and integers [V, nb, 32] (int32)."""
    tensor = next(t for t in GGUFReader(str(gguf_path())).tensors if t.name == "token_embd.weight")
    if int(tensor.tensor_type) != Q8_0:
        raise ValueError(f"token_embd.weight: expected Q8_0, got type {int(tensor.tensor_type)}")
    k, v = (int(s) for s in tensor.shape[:2])
    raw = np.asarray(tensor.data).reshape(v, k // 32, 34)
    scales = raw[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
    ints = raw[..., 2:].copy().view(np.int8).astype(np.int32)
    return torch.from_numpy(scales), torch.from_numpy(ints)


def main() -> None:
    directory = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    scales, ints = head_blocks()
    v, nb, _ = ints.shape
    exact_w = (scales[..., None] * ints).reshape(v, -1)
    proxy_w = (scales[..., None] * (16 * (ints >> 4) + 7.5)).reshape(v, -1)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            x = model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
        exact, proxy = exact_w @ x, proxy_w @ x
        bound = 7.5 * scales @ x.reshape(nb, 32).abs().sum(1)
        if not bool(((exact - proxy).abs() <= bound * (1 + 1e-4) + 1e-4).all()):
            raise AssertionError("the bound does not hold")
        kept = int((proxy + bound >= (proxy - bound).max()).sum())
        top = exact.topk(2).values
        print(f"{prompt!r}: top-1/top-2 gap {float(top[0] - top[1]):.3f}, median bound "
              f"{float(bound.median()):.3f}, screen keeps {kept} of {v} tokens", flush=True)


if __name__ == "__main__":
    main()
