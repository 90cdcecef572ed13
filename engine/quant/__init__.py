"""Quantized weights: GGUF files served directly, weights kept block-quantized in memory.

`formats` (GGML block layouts, dequantization bit-equal to gguf-py), `qlinear` (the linear and
embedding layers over quantized rows), `gguf_file` (reading a GGUF: tensors, config and
tokenizer from its metadata), `gguf_arch` (the GGUF architectures mapped, llama and gemma3:
config from metadata, tensor names and conventions), `gguf_model` (our model built from a
GGUF), `select` (the start-up measurement choosing kernel vs dequantize-and-BLAS), `int8`
(weight-only int8 of a Hugging Face checkpoint at load, through the same layers). See
docs/quantization.md.
"""
