"""Weight-only int8 of a Hugging Face checkpoint at load (`quantization="int8"`, engine flag
`--quantization int8`): W8A16-style, every decoder projection re-stored as GGUF Q8_0 (int8
in blocks of 32 along K, one fp16 scale a block — finer than one scale per output channel, at
0.5 bit a weight more) and run by the quantized GEMM of engine.quant.qlinear.

The embedding, the norms and the LM head stay in the model's dtype (the head decides every
token; vLLM's weight-only methods leave it unquantized too). The quantizer is gguf-py's
reference one, so a layer's weights are exactly what llama.cpp would store for it.

Invariant: the returned model is the same object, re-classed as QuantLlamaForCausalLM, its
projections replaced; nothing else changes.
"""

from __future__ import annotations

import logging

import torch

from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.quant import formats
from engine.quant.gguf_model import QuantLlamaForCausalLM
from engine.quant.qlinear import QuantLinear, QuantTensor

logger = logging.getLogger("kvfleet.engine")

_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def _to_q8(linear: torch.nn.Linear) -> QuantLinear:
    weight = linear.weight.detach().float()
    bias = None if linear.bias is None else linear.bias.detach().float()
    part = QuantTensor(formats.quantize(weight, formats.Q8_0), formats.Q8_0, weight.shape[1])
    return QuantLinear([part], bias)


@torch.no_grad()
def quantize_int8(model: LlamaForCausalLM) -> QuantLlamaForCausalLM:
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("quantization='int8' runs on CPU only (the kernel is a CPU kernel)")
    if model.config.hidden_size % 32 or model.config.intermediate_size % 32:
        raise ValueError("quantization='int8' needs hidden and intermediate sizes that are "
                         "multiples of 32")
    for layer in model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        for block, name in _PROJECTIONS:
            parent = getattr(layer, block)
            setattr(parent, name, _to_q8(getattr(parent, name)))
    model.__class__ = QuantLlamaForCausalLM
    assert isinstance(model, QuantLlamaForCausalLM)
    logger.info("int8 weights: %.1f MiB as loaded", model.weight_bytes / 2**20)
    return model
