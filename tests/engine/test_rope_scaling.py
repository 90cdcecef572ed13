"""RoPE scaling types against transformers' own rotary embeddings (float32), and end to end.

The cos/sin tables of `RotaryEmbedding` for linear, llama3, yarn and longrope equal what
transformers' rotary embedding module returns for the same config (attention factor
included), to float32 rounding; longrope within original_max_position_embeddings (where
transformers uses the short factors). Then yarn (Qwen3) and longrope (Phi-3) checkpoints
give transformers' greedy tokens through the engine. "dynamic" is refused at load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.models import ModelConfig
from engine.models.rope import RotaryEmbedding
from tests.fixtures.family_exactness import check_mode, family_reference
from tests.fixtures.family_models import build_family_dir

HEAD_DIM = 16
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
            "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "linear": ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama3": ("llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "yarn": ("qwen3", YARN),
    "longrope": ("phi3", LONGROPE),
}
_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}


def hf_config(model_type: str, rope: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    extra = {"original_max_position_embeddings": 128} if model_type == "phi3" else {}
    return AutoConfig.for_model(
        model_type, vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=HEAD_DIM, num_hidden_layers=1, intermediate_size=32,
        max_position_embeddings=512, rope_parameters=rope, pad_token_id=0, eos_token_id=1,
        **extra,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_tables_match_transformers(case: str) -> None:
    import transformers

    model_type, rope = CASES[case]
    config = hf_config(model_type, rope)
    hf_cls = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    positions = torch.arange(120)
    cos_ref, sin_ref = hf_cls(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = ModelConfig.from_dict({**config.to_dict(), "architectures": [_ARCH[model_type]]})
    rotary = RotaryEmbedding(HEAD_DIM, 512, ours.rope_theta, ours.rope_scaling)
    cos, sin = rotary.lookup(positions, torch.float32)
    half = HEAD_DIM // 2
    torch.testing.assert_close(cos[:, 0], cos_ref[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], sin_ref[0, :, :half], atol=1e-6, rtol=0)


def test_dynamic_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        ModelConfig.from_dict({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
        })


@pytest.mark.parametrize(("model_type", "rope", "extra"), [
    ("qwen3", YARN, {}),
    ("phi3", LONGROPE, {"original_max_position_embeddings": 128}),
])
def test_scaled_checkpoint_greedy_matches_transformers(tmp_path: Path, model_type, rope, extra):
    model_dir = build_family_dir(tmp_path, model_type, rope_parameters=rope, **extra)
    prompts, reference = family_reference(model_dir)
    check_mode(model_dir, prompts, reference, "chunked-16")
