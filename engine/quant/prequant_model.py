"""A model loaded from a pre-quantized AWQ or GPTQ (int4) Hugging Face checkpoint.

`load_prequant_model` builds our decoder for the checkpoint's architecture on the meta device,
fills every unquantized tensor (embedding, norms, LM head, biases) through the model's own
`load_weights`, and replaces each decoder projection with a `QuantLinear` over its int4
weight repacked once into Q4_1 rows (engine.quant.int4_repack; fused q/k/v and gate/up are the
parts stacked, in the order engine.models.weight_names gives them). The projections stay
4-bit in memory and run on the quantized CPU kernels; the model is re-classed as its quantized
counterpart (engine.quant.at_load.as_quant), whose prepack measures the kernels' plan and packs
the dense head.

Invariants: every quantized tensor lands in a projection and every decoder projection is
quantized (ValueError naming the tensor otherwise); all other parameters are loaded as a dense
checkpoint's are; CPU only (the CUDA kernel, kernels/triton/w4a16.py, is not wired into the
model: a CUDA device is refused naming it).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch

from engine.models.config import ModelConfig
from engine.models.linear import Linear
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import iter_safetensors, safetensors_files
from engine.models.registry import model_class
from engine.models.weight_names import WeightNames
from engine.quant.at_load import PROJECTIONS, as_quant
from engine.quant.gguf_model import QuantLlamaForCausalLM
from engine.quant.int4_repack import to_q4_1
from engine.quant.int4_unpack import unpack_int4
from engine.quant.prequant_config import PrequantConfig, parse_prequant_config
from engine.quant.qlinear import QuantLinear, QuantTensor

logger = logging.getLogger("kvfleet.engine")

_QUANT_LEAVES = frozenset({"qweight", "qzeros", "scales", "g_idx"})


def prequant_config_of(model_dir: str | Path) -> PrequantConfig | None:
    """The checked quantization_config of `model_dir`'s config.json, None if it has none."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    with path.open(encoding="utf-8") as f:
        raw = json.load(f).get("quantization_config")
    return None if not raw else parse_prequant_config(raw)


def load_prequant_model(model_dir: str | Path, config: ModelConfig, quant: PrequantConfig,
                        dtype: torch.dtype, device: str | torch.device = "cpu",
                        ) -> QuantLlamaForCausalLM:
    if torch.device(device).type != "cpu":
        raise ValueError(f"{quant.method} checkpoints are served on CPU only for now (device="
                         f"{torch.device(device).type!r}); the Triton W4A16 kernel is not wired "
                         "into the model")
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    plain: list[tuple[str, torch.Tensor]] = []
    quantized: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in iter_safetensors(safetensors_files(Path(model_dir))):
        prefix, _, leaf = name.rpartition(".")
        if leaf in _QUANT_LEAVES:
            quantized[prefix][leaf] = tensor
        else:
            plain.append((name, tensor))
    _replace_projections(model, _parts_by_param(model, quantized, quant))
    model.load_weights(plain)
    model.eval()
    model.requires_grad_(False)
    as_quant(model)
    assert isinstance(model, QuantLlamaForCausalLM)
    logger.info("%s int4 checkpoint: weights %.1f MiB as loaded (projections as Q4_1)",
                quant.method, model.weight_bytes / 2**20)
    return model


def _parts_by_param(model: LlamaForCausalLM, quantized: dict[str, dict[str, torch.Tensor]],
                    quant: PrequantConfig) -> dict[str, list[tuple[int, QuantTensor]]]:
    """Our projection parameter name -> its (first row, Q4_1 rows) parts."""
    names = WeightNames(model.config, model.lm_head is None)
    parts: dict[str, list[tuple[int, QuantTensor]]] = defaultdict(list)
    for prefix, tensors in quantized.items():
        target = names.target(f"{prefix}.weight")
        if target is None or target.expert is not None:
            raise ValueError(f"{prefix}: quantized tensors with no int4 projection to fill "
                             "(MoE experts and unknown modules are not supported)")
        start = 0 if target.rows is None else target.rows[0]
        parts[target.param].append((start, to_q4_1(unpack_int4(prefix, tensors, quant))))
    return parts


def _replace_projections(model: LlamaForCausalLM,
                         parts: dict[str, list[tuple[int, QuantTensor]]]) -> None:
    for i, layer in enumerate(model.layers):
        for block, name in PROJECTIONS:
            parent = getattr(layer, block, None)
            dense = getattr(parent, name, None)
            key = f"layers.{i}.{block}.{name}.weight"
            if not isinstance(dense, Linear):
                raise ValueError(f"{key}: int4 checkpoints are supported for dense decoders "
                                 "only")
            found = sorted(parts.pop(key, []), key=lambda p: p[0])
            if sum(t.rows for _, t in found) != dense.out_features:
                raise ValueError(f"{key}: the checkpoint's int4 parts hold "
                                 f"{sum(t.rows for _, t in found)} of {dense.out_features} rows "
                                 "(every projection must be quantized)")
            bias = None if dense.bias is None else dense.bias.detach()
            setattr(parent, name, QuantLinear([t for _, t in found], bias))
    if parts:
        raise ValueError(f"int4 tensors with no projection: {sorted(parts)[:8]}")
