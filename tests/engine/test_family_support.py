"""What each model family supports, and what it refuses at start (naming family and feature).

Config-level only (config.json, no weights): an unsupported architecture is a clear error; a
feature a family cannot run yet (LoRA, speculative decoding, the Triton attention kernel) is
refused before any weight is loaded; family defaults resolve as transformers' config classes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine import LLM
from engine.models import ModelConfig
from engine.models.registry import FAMILIES, supports_cuda_graphs

BASE: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
}


def config(architecture: str, **extra: Any) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [architecture], **BASE, **extra})


def write_config(tmp_path: Path, architecture: str) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], **BASE}))
    return tmp_path


def test_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'FalconForCausalLM'.*"
                                         "Gemma2ForCausalLM"):
        config("FalconForCausalLM")


def test_every_supported_architecture_parses() -> None:
    for architecture in FAMILIES:
        assert config(architecture).architecture == architecture


def test_gemma_defaults_follow_transformers() -> None:
    gemma2 = config("Gemma2ForCausalLM")
    assert gemma2.layer_windows == (4096, None, 4096, None)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.tie_word_embeddings and gemma2.attn_scale == 16**-0.5
    gemma3 = config("Gemma3ForCausalLM", num_hidden_layers=7, rope_theta=1e6,
                    rope_local_base_freq=1e4)
    assert gemma3.layer_windows == (4096,) * 5 + (None, 4096)
    assert gemma3.final_logit_softcap is None and gemma3.qk_norm
    assert (gemma3.rope_theta, gemma3.sliding_rope_theta) == (1e6, 1e4)


def test_qwen3_moe_layers() -> None:
    moe = config("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
                 decoder_sparse_step=2, mlp_only_layers=[3])
    assert moe.moe_layers == (False, True, False, False)
    assert not moe.norm_topk_prob and moe.num_experts == 8


@pytest.mark.parametrize(
    ("architecture", "engine_args", "feature"),
    [
        ("Phi3ForCausalLM", {"enable_lora": True}, "LoRA"),
        ("MixtralForCausalLM", {"enable_lora": True}, "LoRA"),
        ("Qwen3MoeForCausalLM", {"enable_lora": True}, "LoRA"),
    ],
)
def test_unsupported_feature_refused_at_start(tmp_path, architecture, engine_args, feature):
    with pytest.raises(ValueError, match=f"{architecture} does not support .*{feature}"):
        LLM(str(write_config(tmp_path, architecture)), **engine_args)


def test_moe_decodes_without_cuda_graphs() -> None:
    """MoE reads per-expert row counts on the host, which a captured graph cannot."""
    assert not supports_cuda_graphs("MixtralForCausalLM")
    assert not supports_cuda_graphs("Qwen3MoeForCausalLM")
    assert supports_cuda_graphs("Gemma2ForCausalLM") and supports_cuda_graphs("Qwen3ForCausalLM")
