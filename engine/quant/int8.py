"""Weight-only int8 of a Hugging Face checkpoint at load (`quantization="int8"`, engine flag
`--quantization int8`): W8A16-style, every decoder projection re-stored as GGUF Q8_0 (int8
in blocks of 32 along K, one fp16 scale a block — finer than one scale per output channel, at
0.5 bit a weight more) and run by the quantized GEMM of engine.quant.qlinear.

The quantizer is gguf-py's reference one, so a layer's weights are exactly what llama.cpp
would store for it; what stays dense and the invariants are engine.quant.at_load's.
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.quant import formats
from engine.quant.at_load import requantize_projections
from engine.quant.gguf_model import QuantLlamaForCausalLM


def quantize_int8(model: LlamaForCausalLM) -> QuantLlamaForCausalLM:
    return requantize_projections(model, formats.Q8_0, "int8")
