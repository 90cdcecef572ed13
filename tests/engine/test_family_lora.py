"""LoRA on the new families whose checkpoints keep q/k/v and gate/up apart (Qwen3, Gemma 2):
a PEFT adapter on all seven projections and the base model in one batch, chunked, give
transformers + peft's greedy tokens (float32). Qwen3's q/k norms run after the adapted qkv
projection; Gemma's adapted gate/up feed GeGLU. (Phi-3's fused projections and MoE experts
are refused at start, tests/engine/test_family_support.py.)"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.lora.request import LoRARequest
from tests.fixtures.family_exactness import GREEDY, NEW_TOKENS
from tests.fixtures.family_models import build_family_dir
from tests.fixtures.greedy import random_prompts, run_checked
from tests.fixtures.lora_adapters import ADAPTERS, build_adapter_dir, peft_model

PROMPT_LENGTHS = [5, 40]


def _peft_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        generated = model.generate(  # type: ignore[operator]
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )
        outputs.append(generated[0, len(ids):].tolist())
    return outputs


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_adapter_and_base_in_one_chunked_batch(tmp_path, model_type):
    model_dir = build_family_dir(tmp_path / "model", model_type)
    spec = ADAPTERS[0]  # all seven projections, rank 8
    adapter_dir = build_adapter_dir(model_dir, spec, tmp_path / "adapter")
    prompts = random_prompts(model_dir, PROMPT_LENGTHS, seed=5)
    expected = _peft_greedy(peft_model(model_dir, spec), prompts)
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=1,
              max_num_batched_tokens=16, linear_backend="dense")
    engine = llm.engine
    adapter = LoRARequest(spec.name, 1, str(adapter_dir))
    requests = [engine.add_request(f"lora-{i}", p, GREEDY, lora_request=adapter)
                for i, p in enumerate(prompts)]
    base, _ = run_checked(engine, prompts, GREEDY)  # queued after: base and adapter mixed
    assert [r.output_token_ids for r in requests] == expected
    assert base != expected
