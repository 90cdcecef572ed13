"""benchmarks/family_bench.py's checkpoints (configs only, no weights): every family parses as
kvfleet's model config at SmolLM2-135M's size, and the Gemma ones get sliding-window KV."""

import json

import pytest

from benchmarks.family_bench import FAMILIES, family_config
from engine.core.kv_groups import plan_kv_groups
from engine.models.config import ModelConfig

SMOLLM2 = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_checkpoint_config_is_served_at_smollm2_size(family):
    raw = json.loads(family_config(family, SMOLLM2).to_json_string())
    raw["architectures"] = [ARCHITECTURES[family]]
    config = ModelConfig.from_dict(raw)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (576, 30, 64)
    # SmolLM2-135M's order of size; the MoE ones count all 8 experts of 768 (two of them are
    # one MLP of 1,536 per token).
    assert 100e6 < config.num_parameters < 400e6
    plan = plan_kv_groups(config.layer_windows)
    if family == "gemma2":
        assert plan is not None and plan.group_size == 15 and plan.window == 4096
    elif family == "gemma3":
        assert plan is not None and plan.group_size == 5 and plan.num_groups == 6
    else:
        assert plan is None
