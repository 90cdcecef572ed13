"""Quantized weights: GGUF files served directly, weights kept block-quantized in memory.

`formats` (GGML block layouts, dequantization bit-equal to gguf-py), `qlinear` (the linear and
embedding layers over quantized rows), `gguf_file` (reading a GGUF: tensors, config and
tokenizer from its metadata), `gguf_arch` (the GGUF architectures mapped, llama and gemma3:
config from metadata, tensor names and conventions), `gguf_model` (our model built from a
GGUF), `select` (the start-up measurement choosing kernel vs dequantize-and-BLAS), `at_load`
with `int8` / `int4` (weight-only int8 / int4 of a Hugging Face checkpoint at load, through the
same layers), and pre-quantized AWQ / GPTQ checkpoints: `prequant_config` (their
quantization_config, checked), `int4_unpack` (their packed tensors), `int4_repack` (into Q4_1
for the CPU kernels), `w4a16_model` (the Triton W4A16 layers), `prequant_model` (loading). See
docs/quantization.md.
"""
