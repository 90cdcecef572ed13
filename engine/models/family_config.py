"""Config fields of the model families beyond Llama: Qwen3, Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE.

`family_fields(raw, architecture)` returns the keyword arguments `ModelConfig` takes for the
family's features (q/k norm, Gemma's layout, soft-capping, per-layer sliding windows, MoE
routing), resolved with the defaults transformers' config classes apply, so the model code
never reads config.json. The Llama-family architectures get an empty dict (every default).

Invariants: every per-layer tuple has exactly `num_hidden_layers` entries; an option the
engine does not implement raises ValueError naming it, never computes something else.
"""

from __future__ import annotations

from typing import Any

FAMILY_ARCHITECTURES = (
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
)

# Multimodal checkpoints whose text model we serve: architecture -> the text model's.
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}

_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
_GEMMA_DEFAULT_WINDOW = 4096
_GEMMA3_DEFAULT_PATTERN = 6
_GEMMA3_DEFAULT_LOCAL_THETA = 10000.0


def text_config_of(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config.json as its text model's (`text_config` with the
    text architecture; ids and tying from the outer config where it has them); others as
    they are. Images are not supported: the engine serves the language model alone."""
    architectures = raw.get("architectures") or []
    if not architectures or architectures[0] not in TEXT_OF_MULTIMODAL:
        return raw
    text = dict(raw.get("text_config") or {})
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "dtype", "torch_dtype"):
        if key in raw:
            text[key] = raw[key]
    return {**text, "architectures": [TEXT_OF_MULTIMODAL[architectures[0]]], "multimodal": True}


def family_fields(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """`ModelConfig` keyword arguments for `architecture`'s own features."""
    if architecture == "Qwen3ForCausalLM":
        return {"qk_norm": True}
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return {**_gemma_fields(raw, architecture), "multimodal": bool(raw.get("multimodal"))}
    if architecture == "MixtralForCausalLM":
        return _moe_fields(raw, int(raw.get("intermediate_size", 14336)), renormalize=True,
                           moe_layers=(True,) * int(raw["num_hidden_layers"]))
    if architecture == "Qwen3MoeForCausalLM":
        return {"qk_norm": True, **_qwen3_moe_fields(raw)}
    return {}


def _gemma_fields(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GEMMA_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {act!r} for {architecture}")
    gemma3 = architecture == "Gemma3ForCausalLM"
    num_layers = int(raw["num_hidden_layers"])
    window = int(raw.get("sliding_window") or _GEMMA_DEFAULT_WINDOW)
    layer_types = raw.get("layer_types") or _default_layer_types(raw, num_layers, gemma3)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer_types {sorted(unknown)}")
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
    scalar = raw.get("query_pre_attn_scalar") or head_dim
    fields: dict[str, Any] = {
        "hidden_act": act,
        "gemma": True,
        "qk_norm": gemma3,
        "attn_scale": float(scalar) ** -0.5,
        "attn_logit_softcap": _cap(raw, "attn_logit_softcapping", None if gemma3 else 50.0),
        "final_logit_softcap": _cap(raw, "final_logit_softcapping", None if gemma3 else 30.0),
        "layer_windows": tuple(window if t == "sliding_attention" else None for t in layer_types),
    }
    if gemma3:
        fields["sliding_rope_theta"] = _gemma3_local_theta(raw)
    return fields


def _default_layer_types(raw: dict[str, Any], num_layers: int, gemma3: bool) -> list[str]:
    """transformers' defaults: Gemma 2 alternates (sliding first), Gemma 3 puts one global
    layer after every pattern - 1 sliding ones."""
    pattern = (
        int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
            or _GEMMA3_DEFAULT_PATTERN)
        if gemma3 else 2
    )
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)]


def _gemma3_local_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported sliding-layer rope_type {local.get('rope_type')!r}")
        return float(local.get("rope_theta") or _GEMMA3_DEFAULT_LOCAL_THETA)
    return float(raw.get("rope_local_base_freq") or _GEMMA3_DEFAULT_LOCAL_THETA)


def _cap(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    return float(value) if value else None


def _moe_fields(
    raw: dict[str, Any], expert_size: int, renormalize: bool, moe_layers: tuple[bool, ...]
) -> dict[str, Any]:
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 8)
    top_k = int(raw.get("num_experts_per_tok") or 2)
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} is not within 1..{experts} experts")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_size,
        "norm_topk_prob": renormalize,
        "moe_layers": moe_layers,
    }


def _qwen3_moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    num_layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 128)
    # transformers' Qwen3MoeDecoderLayer: MoE where not listed dense and (i + 1) % step == 0.
    layers = tuple(
        i not in dense and experts > 0 and step > 0 and (i + 1) % step == 0
        for i in range(num_layers)
    )
    return _moe_fields(raw, int(raw.get("moe_intermediate_size", 768)),
                       renormalize=bool(raw.get("norm_topk_prob", False)), moe_layers=layers)
