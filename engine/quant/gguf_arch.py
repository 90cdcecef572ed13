"""The GGUF architectures kvfleet maps onto its own model code: config from metadata, and how
llama.cpp's per-layer tensor names and conventions translate to our modules.

- `llama` (Llama, SmolLM2, llama-layout Mistral): `engine.models.llama`; llama.cpp's converter
  interleaves each head's RoPE halves in the q/k rows (`unpermute_qk`).
- `gemma3` (Gemma 3 text models, e.g. Gemma 3 270M): `engine.models.gemma`; llama.cpp stores
  every RMSNorm weight as `1 + w` (its norm multiplies by the weight), so the loader subtracts
  `norm_offset` in float32, as transformers' GGUF loader does; q/k rows are not permuted; five
  sliding layers with their own RoPE base (10000, llama.cpp's fixed value) per global layer.

Invariant: a config built here is what transformers builds from the same metadata (the
exactness tests compare against transformers loading the file); anything not mapped raises
ValueError naming the architecture or the metadata key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# llama.cpp's Gemma 3 graph: one global layer after every five sliding ones, and a fixed RoPE
# base for the sliding layers (the HF config's rope_local_base_freq is not written to GGUF).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0


@dataclass(frozen=True)
class GgufArch:
    """How one GGUF architecture's tensors fill our decoder layers."""

    name: str
    config: Callable[[dict[str, Any], set[str]], dict[str, Any]]
    # GGUF layer tensor (`blk.N.<key>.weight`) -> attribute path of the norm on our layer.
    norms: dict[str, str] = field(default_factory=dict)
    unpermute_qk: bool = False
    norm_offset: float = 0.0


def _common(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or 0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        # Dequantized values (fp16 scale * q + min) are exact in float32, not in bfloat16.
        "dtype": "float32",
    }
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or meta.get(
            f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        raise ValueError(f"unsupported GGUF RoPE scaling in {arch}.rope.scaling.*")
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{theirs}")
        if value is not None:
            config[ours] = int(value)
    return config


def _llama_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            **_common(meta, "llama", tensor_names)}


def _gemma3_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    config = _common(meta, "gemma3", tensor_names)
    layers = config["num_hidden_layers"]
    window = meta.get("gemma3.attention.sliding_window")
    if window is None:
        raise ValueError("GGUF metadata is missing gemma3.attention.sliding_window")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        # transformers' Gemma3TextConfig default, which its GGUF loader keeps; llama.cpp uses
        # head_dim ** -0.5 too (except for the 27B model, whose scalar is not in the file).
        "query_pre_attn_scalar": config["head_dim"],
        "sliding_window": int(window),
        "layer_types": ["sliding_attention" if (i + 1) % _GEMMA3_PATTERN else "full_attention"
                        for i in range(layers)],
        "rope_local_base_freq": _GEMMA3_LOCAL_THETA,
        **config,
    }


ARCHITECTURES: dict[str, GgufArch] = {
    "llama": GgufArch(
        "llama", _llama_config, unpermute_qk=True,
        norms={"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}),
    "gemma3": GgufArch(
        "gemma3", _gemma3_config, norm_offset=1.0,
        norms={"attn_norm": "input_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm"}),
}

# config.json's architecture -> the GGUF architecture it came from (the loader's direction).
BY_MODEL_ARCHITECTURE = {"LlamaForCausalLM": "llama", "Gemma3ForCausalLM": "gemma3"}


def arch_of(name: object) -> GgufArch:
    """The mapping for GGUF `general.architecture` value `name`; ValueError if unsupported."""
    arch = ARCHITECTURES.get(str(name))
    if arch is None:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: "
                         f"{', '.join(repr(a) for a in ARCHITECTURES)}")
    return arch
