"""Re-store a loaded Hugging Face model's decoder projections in one GGML block format.

The common step of the load-time quantizations (`quantization="int8"`: Q8_0, engine.quant.int8;
`"int4"`: Q4_1, engine.quant.int4): every q/k/v, o, gate/up and down projection becomes a
`QuantLinear` over gguf-py's reference quantization of its float32 weight, run by the quantized
GEMM of engine.quant.qlinear. The embedding, the norms and the LM head stay in the model's
dtype (the head decides every token; vLLM's weight-only methods leave it unquantized too).

Invariant: the returned model is the same object, re-classed as QuantLlamaForCausalLM (a Gemma
as QuantGemmaForCausalLM, keeping Gemma's forward), its projections replaced; nothing else
changes.
"""

from __future__ import annotations

import logging

import torch

from engine.models.gemma import GemmaForCausalLM
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.quant import formats
from engine.quant.gguf_model import QuantGemmaForCausalLM, QuantLlamaForCausalLM
from engine.quant.qlinear import QuantLinear, QuantTensor

logger = logging.getLogger("kvfleet.engine")

PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def _requantized(linear: torch.nn.Linear, qtype: int) -> QuantLinear:
    weight = linear.weight.detach().float()
    bias = None if linear.bias is None else linear.bias.detach().float()
    part = QuantTensor(formats.quantize(weight, qtype), qtype, weight.shape[1])
    return QuantLinear([part], bias)


@torch.no_grad()
def requantize_projections(model: LlamaForCausalLM, qtype: int,
                           method: str) -> QuantLlamaForCausalLM:
    """`model` with its projections in `qtype`; `method` names the option in errors."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"quantization={method!r} runs on CPU only (the kernel is a CPU kernel)")
    if model.config.hidden_size % 32 or model.config.intermediate_size % 32:
        raise ValueError(f"quantization={method!r} needs hidden and intermediate sizes that are "
                         "multiples of 32")
    for layer in model.layers:
        if not isinstance(layer, LlamaDecoderLayer) or not hasattr(layer.mlp, "gate_up_proj"):
            raise ValueError(f"quantization={method!r} supports dense (non-MoE) decoders only")
        for block, name in PROJECTIONS:
            parent = getattr(layer, block)
            setattr(parent, name, _requantized(getattr(parent, name), qtype))
    as_quant(model)
    assert isinstance(model, QuantLlamaForCausalLM)
    logger.info("%s weights: %.1f MiB as loaded", method, model.weight_bytes / 2**20)
    return model


def as_quant(model: LlamaForCausalLM) -> None:
    """Re-class `model` in place as its quantized counterpart (the quantized prepack)."""
    model.__class__ = (QuantGemmaForCausalLM if isinstance(model, GemmaForCausalLM)
                       else QuantLlamaForCausalLM)
