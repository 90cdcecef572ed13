"""The engine's LoRA delta through the Triton SGMV kernels (interpreted on CPU): greedy tokens
of two adapters and the base in one batch equal transformers + peft, token for token.

Small on purpose (the interpreter is slow): two prompts (9 and 20 tokens), 4 new tokens, a
32-block cache, the dense linear backend. Launch counters prove the delta ran in the Triton
kernels, not the PyTorch reference.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from kernels.triton import runtime
from tests.fixtures.lora_adapters import ADAPTERS, peft_model

NEW_TOKENS = 4
PROMPTS = [list(range(40, 49)), list(range(100, 120))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _reference(model: torch.nn.Module, ids: list[int]) -> list[int]:
    input_ids = torch.tensor([ids])
    generated = model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        eos_token_id=None,
    )  # fmt: skip
    return generated[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[list[int]]]:
    refs = {}
    for spec in ADAPTERS[:2]:
        model = peft_model(tiny_model_dir, spec)
        refs[spec.name] = [_reference(model, ids) for ids in PROMPTS]
    return refs


def test_two_adapters_and_base_through_triton(tiny_model_dir, tiny_lora_dirs, reference):
    llm = LLM(
        # Compiled on a GPU (make gpu-check), interpreted on CPU.
        str(tiny_model_dir), dtype="float32", attention_backend="triton",
        device="cuda" if torch.cuda.is_available() else "cpu",
        linear_backend="dense", num_kv_blocks=32, enable_lora=True, max_loras=2,
    )  # fmt: skip
    assert llm.engine.lora is not None and llm.engine.lora.context.use_triton
    names = [spec.name for spec in ADAPTERS[:2]]
    loras = [LoRARequest(n, i + 1, str(tiny_lora_dirs[n])) for i, n in enumerate(names)]
    batch = [{"prompt_token_ids": p} for _ in range(3) for p in PROMPTS]
    per_prompt = [lora for lora in [*loras, None] for _ in PROMPTS]
    before = runtime.launch_counts["lora_expand"]
    outs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert runtime.launch_counts["lora_expand"] > before
    got = [o.outputs[0].token_ids for o in outs]
    assert got[: len(PROMPTS)] == reference[names[0]]
    assert got[len(PROMPTS) : 2 * len(PROMPTS)] == reference[names[1]]
    base = LLM(str(tiny_model_dir), dtype="float32", linear_backend="dense")
    want_base = base.generate(batch[-len(PROMPTS) :], GREEDY, use_tqdm=False)
    assert got[2 * len(PROMPTS) :] == [o.outputs[0].token_ids for o in want_base]
