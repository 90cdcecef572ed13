"""A model loaded from a pre-quantized AWQ or GPTQ (int4) Hugging Face checkpoint.

`load_prequant_model` builds our decoder for the checkpoint's architecture on the meta device,
fills every unquantized tensor (embedding, norms, LM head, biases) through the model's own
`load_weights`, and replaces each decoder projection (fused q/k/v and gate/up: the parts in
the order engine.models.weight_names gives them) with one that keeps the int4 weight:

- CPU kernels (the default on CPU): a `QuantLinear` over Q4_1 rows repacked once
  (engine.quant.int4_repack), run by the quantized CPU kernels; the model is re-classed as its
  quantized counterpart (engine.quant.at_load.as_quant), whose prepack measures the kernels'
  plan and packs the dense head.
- Triton (`triton=True`: the engine's Triton backend, always on CUDA): a `W4A16Linear` over
  the codes, scales and zeros (engine.quant.w4a16_model), run by kernels/triton/w4a16.py;
  Llama-class models only.

Invariants: every quantized tensor lands in a projection and every decoder projection is
quantized (ValueError naming the tensor otherwise); all other parameters are loaded as a dense
checkpoint's are.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.linear import Linear
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import iter_safetensors, safetensors_files
from engine.models.registry import model_class
from engine.models.weight_names import WeightNames
from engine.quant.at_load import PROJECTIONS, as_quant
from engine.quant.gguf_model import QuantLlamaForCausalLM
from engine.quant.int4_repack import to_q4_1
from engine.quant.int4_unpack import Int4Weight, unpack_int4
from engine.quant.prequant_config import PrequantConfig, parse_prequant_config
from engine.quant.qlinear import QuantLinear
from engine.quant.w4a16_model import W4A16Linear, W4A16LlamaForCausalLM

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
                        triton: bool = False) -> LlamaForCausalLM:
    device = torch.device(device)
    if not triton and device.type != "cpu":
        raise ValueError(f"{quant.method} checkpoints on device {device.type!r} need the "
                         "Triton backend (attention_backend='triton')")
    cls = model_class(config.architecture)
    if triton and cls is not LlamaForCausalLM:
        raise ValueError(f"{quant.method} checkpoints on the Triton backend support Llama-class "
                         f"architectures only; got {config.architecture!r}")
    with torch.device("meta"):
        model = (W4A16LlamaForCausalLM if triton else cls)(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    plain: list[tuple[str, torch.Tensor]] = []
    quantized: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in iter_safetensors(safetensors_files(Path(model_dir))):
        prefix, _, leaf = name.rpartition(".")
        if leaf in _QUANT_LEAVES:
            quantized[prefix][leaf] = tensor
        else:
            plain.append((name, tensor))
    def make(parts: list[Int4Weight], bias: torch.Tensor | None) -> nn.Module:
        if triton:
            return W4A16Linear(parts, bias, device)
        return QuantLinear([to_q4_1(p) for p in parts], bias)

    _replace_projections(model, _parts_by_param(model, quantized, quant), make)
    model.load_weights(plain)
    model.eval()
    model.requires_grad_(False)
    if not triton:
        as_quant(model)
        assert isinstance(model, QuantLlamaForCausalLM)
        logger.info("%s int4 checkpoint: weights %.1f MiB as loaded (projections as Q4_1)",
                    quant.method, model.weight_bytes / 2**20)
    return model


def _parts_by_param(model: LlamaForCausalLM, quantized: dict[str, dict[str, torch.Tensor]],
                    quant: PrequantConfig) -> dict[str, list[tuple[int, Int4Weight]]]:
    """Our projection parameter name -> its (first row, int4 weight) parts."""
    names = WeightNames(model.config, model.lm_head is None)
    parts: dict[str, list[tuple[int, Int4Weight]]] = defaultdict(list)
    for prefix, tensors in quantized.items():
        target = names.target(f"{prefix}.weight")
        if target is None or target.expert is not None:
            raise ValueError(f"{prefix}: quantized tensors with no int4 projection to fill "
                             "(MoE experts and unknown modules are not supported)")
        start = 0 if target.rows is None else target.rows[0]
        parts[target.param].append((start, unpack_int4(prefix, tensors, quant)))
    return parts


def _replace_projections(model: LlamaForCausalLM,
                         parts: dict[str, list[tuple[int, Int4Weight]]],
                         make: Callable[[list[Int4Weight], torch.Tensor | None], nn.Module],
                         ) -> None:
    for i, layer in enumerate(model.layers):
        for block, name in PROJECTIONS:
            parent = getattr(layer, block, None)
            dense = getattr(parent, name, None)
            key = f"layers.{i}.{block}.{name}.weight"
            if not isinstance(dense, Linear):
                raise ValueError(f"{key}: int4 checkpoints are supported for dense decoders "
                                 "only")
            found = sorted(parts.pop(key, []), key=lambda p: p[0])
            rows = sum(int(t.q.shape[1]) for _, t in found)
            if rows != dense.out_features:
                raise ValueError(f"{key}: the checkpoint's int4 parts hold {rows} of "
                                 f"{dense.out_features} rows (every projection must be quantized)")
            bias = None if dense.bias is None else dense.bias.detach()
            setattr(parent, name, make([t for _, t in found], bias))
    if parts:
        raise ValueError(f"int4 tensors with no projection: {sorted(parts)[:8]}")
