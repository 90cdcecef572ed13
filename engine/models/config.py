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

from engine.models.family_config import (
    FAMILY_ARCHITECTURES,
    TEXT_OF_MULTIMODAL,
    family_fields,
    text_config_of,
)
from engine.models.rope_scaling import (
    LinearRopeScaling,
    Llama3RopeScaling,
    RopeScaling,
    parse_scaling,
)

__all__ = ["Llama3RopeScaling", "LinearRopeScaling", "ModelConfig", "RopeScaling"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", *FAMILY_ARCHITECTURES,
    *TEXT_OF_MULTIMODAL,
)

# transformers' config-class defaults, applied when config.json omits the key.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 4096 * 32,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
    "Qwen3MoeForCausalLM": 32768,
    "Gemma2ForCausalLM": 8192,
    "Gemma3ForCausalLM": 131072,
    "Phi3ForCausalLM": 4096,
    "MixtralForCausalLM": 4096 * 32,
}
_O_PROJ_BIAS = (
    "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)


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
    rope_scaling: RopeScaling | None
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
    # --- Family features (engine.models.family_config resolves them; defaults = Llama).
    # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # MLP activation: "silu" or "gelu_pytorch_tanh" (Gemma's GeGLU).
    hidden_act: str = "silu"
    # Gemma layout: (1 + w) RMSNorms, pre/post feed-forward norms, embedding x sqrt(hidden).
    gemma: bool = False
    # Softmax scale of attention; None: head_dim ** -0.5.
    attn_scale: float | None = None
    # tanh soft-capping of attention scores / of the final logits; None: no cap.
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Per layer: its sliding window (keys with q - k < window), None for full attention.
    # Empty: no layer slides this way (the legacy `sliding_window` cap applies instead).
    layer_windows: tuple[int | None, ...] = ()
    # RoPE base of the sliding-window layers (Gemma 3's local layers, unscaled); None: the
    # same rotary embedding as every other layer.
    sliding_rope_theta: float | None = None
    # Mixture of experts: experts per MoE layer (0: dense), routed per token, expert width,
    # whether the top-k weights are renormalised, and which layers are MoE.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    # The text model of a multimodal checkpoint (Gemma3ForConditionalGeneration): its
    # tensors sit under language_model., the vision tower's are skipped.
    multimodal: bool = False

    def is_moe_layer(self, index: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[index]

    def window_of(self, index: int) -> int | None:
        return self.layer_windows[index] if self.layer_windows else None

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
        """Parameter count of the decoder (embedding, layers, final norm, untied LM head;
        q/k norms and biases left out: they are a rounding error)."""
        hidden, inter = self.hidden_size, self.intermediate_size
        attention = hidden * (self.q_size + 2 * self.kv_size) + self.q_size * hidden
        dense_mlp = 3 * hidden * inter
        moe_mlp = self.num_experts * (3 * hidden * self.moe_intermediate_size + hidden)
        mlps = sum(moe_mlp if self.is_moe_layer(i) else dense_mlp
                   for i in range(self.num_hidden_layers))
        embed = self.vocab_size * hidden
        head = 0 if self.tie_word_embeddings else embed
        norms = 4 if self.gemma else 2
        return (embed + self.num_hidden_layers * (attention + norms * hidden) + mlps + hidden
                + head)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        with path.open(encoding="utf-8") as f:
            raw = json.load(f)
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        raw = text_config_of(raw)
        architecture = _architecture(raw)
        _check_supported_features(raw, architecture)
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        extras = family_fields(raw, architecture)
        rope_theta, rope_scaling = _parse_rope(raw)
        qkv_bias = architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
        # HF ties o_proj's bias to attention_bias where the family has one (Qwen2 never).
        o_proj_bias = architecture in _O_PROJ_BIAS and bool(raw.get("attention_bias", False))
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
            # Gemma's config classes default to tied embeddings, the others to untied.
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", architecture.startswith("Gemma"))),
            qkv_bias=qkv_bias,
            o_proj_bias=o_proj_bias,
            sliding_window=_sliding_window(raw, architecture),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
            **extras,
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


def _check_supported_features(raw: dict[str, Any], architecture: str) -> None:
    if architecture.startswith("Gemma"):
        return  # hidden_activation is checked by engine.models.family_config
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is implemented")
    if raw.get("mlp_bias", False):
        raise ValueError("unsupported mlp_bias=True; the MLP is implemented without bias")
    if raw.get("quantization_config"):
        # AWQ / GPTQ int4 are read by engine.quant.prequant_model; anything else is refused
        # here, naming the field.
        from engine.quant.prequant_config import parse_prequant_config

        parse_prequant_config(raw["quantization_config"])


def _max_positions(raw: dict[str, Any], architecture: str) -> int:
    return int(raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[architecture])


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Resolve rope_theta and scaling from either spelling, as transformers standardizes them."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if isinstance(params.get("full_attention"), dict):
        # Per layer type (Gemma 3): the global layers' rope is the model's; the sliding
        # layers' base is engine.models.family_config's sliding_rope_theta.
        params = dict(params["full_attention"])
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("unsupported per-layer-type rope_parameters")
    theta = params.get("rope_theta") or raw.get("rope_theta") or _DEFAULT_ROPE_THETA
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    # transformers gives a top-level original_max_position_embeddings priority.
    max_positions = _max_positions(raw, str(raw["architectures"][0]))
    original = int(
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_positions
    )
    return float(theta), parse_scaling(str(rope_type), params, original, max_positions)


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    """The window that caps max_model_len (attention without a window computes it exactly
    below it), or None. Gemma's windows are computed exactly per layer instead."""
    if architecture in ("LlamaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return None
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        # MistralConfig's class default is 4096 when the key is missing altogether.
        default = 4096 if architecture == "MistralForCausalLM" else None
        window = raw.get("sliding_window", default)
        return int(window) if window is not None else None
    # Qwen2/3: only with use_sliding_window, and only layers >= max_window_layers slide.
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
