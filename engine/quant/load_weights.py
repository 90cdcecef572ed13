"""Which loader builds an engine's model, by the weights' format.

One decision, made once at engine start: a GGUF file goes to its own loader (weights stay
GGML-quantized); a checkpoint whose config.json carries an AWQ/GPTQ `quantization_config`
goes to the pre-quantized loader (4-bit weights, Triton W4A16 layers where the engine runs
Triton); anything else loads dense and is then re-stored as int8 or int4 when `quantization`
asks. Invariant: `quantization` naming awq/gptq must match the checkpoint's own
quant_method, and a pre-quantized checkpoint is never loaded as dense.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model
from engine.quant.gguf_model import load_gguf_model
from engine.quant.int4 import quantize_int4
from engine.quant.int8 import quantize_int8
from engine.quant.prequant_model import load_prequant_model, prequant_config_of


def load_engine_model(
    model_dir: Path, gguf_file: Path | None, model_config: ModelConfig, quantization: str | None,
    dtype: torch.dtype, device: torch.device, triton: bool,
) -> LlamaForCausalLM:  # fmt: skip
    """The model in its weights' format (module docstring). ValueError naming
    `quantization` when it contradicts the checkpoint."""
    if gguf_file is not None:
        return load_gguf_model(gguf_file, model_config, dtype, device)
    prequant = prequant_config_of(model_dir)
    if prequant is not None or quantization in ("awq", "gptq"):
        if prequant is None or quantization not in (None, prequant.method):
            raise ValueError(
                f"quantization={quantization!r} does not match the checkpoint at {model_dir} "
                f"(its quantization_config.quant_method: "
                f"{None if prequant is None else prequant.method!r})")
        return load_prequant_model(model_dir, model_config, prequant, dtype, device,
                                   triton=triton)
    model = load_model(model_dir, dtype, device)[0]
    if quantization == "int8":
        return quantize_int8(model)
    if quantization == "int4":
        return quantize_int4(model)
    return model
