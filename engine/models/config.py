"""`ModelConfig`: the model's shape and numerics, parsed once from a Hugging Face config.json.

Invariants: the object is frozen and holds only plain values, so it can be shared by every
component (model, loader, runner, scheduler) without anyone re-reading config.json. Every
field is resolved here, defaults included, with the same defaults transformers' config classes
apply, so the model code never has to guess. Unsupported architectures or features raise
`ValueError` naming the offending value instead of silently computing something else.

Both RoPE spellings are accepted: transformers 4 (`rope_theta` + `rope_scaling`) and
transformers 5 (`rope_parameters` holding `rope_theta`, `rope_type` and scaling fields).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# transformers' config-class defaults, applied when config.json omits the key.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 4096 * 32,
    "Qwen2ForCausalLM": 32768,
}


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1-style frequency-dependent RoPE scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything the Llama-family decoder needs, resolved from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Bias on q/k/v projections (Qwen2 always; Llama/Mistral via `attention_bias`).
    qkv_bias: bool
    # Bias on the output projection: HF Llama ties it to `attention_bias`; Qwen2 never has one.
    o_proj_bias: bool
    # Effective sliding window, None when no layer actually slides. The attention backend
    # has no windowing, so the engine must keep contexts within `max_model_len`.
    sliding_window: int | None
    # The checkpoint's dtype string from config.json ("bfloat16", "float32", ...), if any.
    dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def max_model_len(self) -> int:
        """Longest context this engine computes exactly (full attention == sliding below it)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameter count of the decoder (embedding, layers, final norm, untied LM head)."""
        hidden, inter = self.hidden_size, self.intermediate_size
        per_layer = (
            hidden * (self.q_size + 2 * self.kv_size) + self.q_size * hidden
            + 3 * hidden * inter + 2 * hidden
        )
        embed = self.vocab_size * hidden
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_hidden_layers * per_layer + hidden + head

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        with path.open(encoding="utf-8") as f:
            raw = json.load(f)
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(raw)
        _check_supported_features(raw)
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        rope_theta, rope_scaling = _parse_rope(raw)
        qkv_bias = architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
        o_proj_bias = architecture == "LlamaForCausalLM" and bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_max_positions(raw, architecture),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_proj_bias=o_proj_bias,
            sliding_window=_sliding_window(raw, architecture),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
        )


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
    name = architectures[0]
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(name)


def _check_supported_features(raw: dict[str, Any]) -> None:
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is implemented")
    if raw.get("mlp_bias", False):
        raise ValueError("unsupported mlp_bias=True; the MLP is implemented without bias")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method")
        raise ValueError(f"unsupported quantized checkpoint (quant_method={method!r})")


def _max_positions(raw: dict[str, Any], architecture: str) -> int:
    return int(raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[architecture])


def _parse_rope(raw: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Resolve rope_theta and scaling from either spelling, as transformers standardizes them."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("unsupported per-layer-type rope_parameters")
    theta = params.get("rope_theta") or raw.get("rope_theta") or _DEFAULT_ROPE_THETA
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: 'default', 'llama3'")
    # transformers gives a top-level original_max_position_embeddings priority.
    original = (
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or _max_positions(raw, str(raw["architectures"][0]))
    )
    scaling = Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original),
    )
    return float(theta), scaling


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    """The window the checkpoint's attention actually applies, or None for full attention."""
    if architecture == "LlamaForCausalLM":
        return None
    if architecture == "MistralForCausalLM":
        # MistralConfig's class default is 4096 when the key is missing altogether.
        window = raw.get("sliding_window", 4096)
        return int(window) if window is not None else None
    # Qwen2: only with use_sliding_window, and only layers >= max_window_layers slide.
    window = raw.get("sliding_window", 4096)
    if not raw.get("use_sliding_window", False) or window is None:
        return None
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        slides = "sliding_attention" in layer_types
    else:
        slides = int(raw["num_hidden_layers"]) > int(raw.get("max_window_layers", 28))
    return int(window) if slides else None


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
