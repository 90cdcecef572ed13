"""Weight-only int4 of a Hugging Face checkpoint at load (`quantization="int4"`, engine flag
`--quantization int4`): group-wise 4-bit, every decoder projection re-stored as GGUF Q4_1 —
groups of 32 weights along K, each 4-bit code q in 0..15 with an fp16 scale d and minimum m,
weight = d * q + m (asymmetric, 5 bits a weight in all) — and run by the quantized GEMM of
engine.quant.qlinear (the same register, panel and factored bfloat16 kernels as a Q4_1 GGUF).

Q4_1 rather than Q4_0 (symmetric, d * (q - 8)): the minimum follows each group's range, which
halves the rounding error of a group whose weights are not centred on zero, for 0.5 bit a
weight more. The quantizer is gguf-py's reference one (what llama.cpp stores for the layer);
what stays dense and the invariants are engine.quant.at_load's.
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.quant import formats
from engine.quant.at_load import requantize_projections
from engine.quant.gguf_model import QuantLlamaForCausalLM


def quantize_int4(model: LlamaForCausalLM) -> QuantLlamaForCausalLM:
    return requantize_projections(model, formats.Q4_1, "int4")
