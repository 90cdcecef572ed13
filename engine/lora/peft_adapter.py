"""Read a PEFT LoRA directory into weights laid out for our fused projections.

A PEFT adapter is `adapter_config.json` + `adapter_model.safetensors` holding, per targeted
Hugging Face projection, `...layers.L.<block>.<proj>.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]. PEFT computes `base(x) + lora_B(lora_A(x)) * scaling` with
`scaling = lora_alpha / r` (or `lora_alpha / sqrt(r)` with `use_rslora`), r being the module's
own rank (so `rank_pattern` needs nothing special: ranks come from the tensors).

Our model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; each HF projection is
one *slice* of a fused projection (`TARGETS`). `LoRAAdapter.weights[(layer, projection)]` has
one entry per slice: (A [r, in], B * scaling [out_slice, r]) or None where the adapter leaves
that slice alone. Scaling is folded into B once here.

Invariants: everything is validated before an adapter is returned — a bad adapter raises
`LoRAAdapterError` (a ValueError, so services answer INVALID_ARGUMENT / 400) naming the
problem: a missing file, an unsupported PEFT feature or module, a rank above
`max_lora_rank`, or shapes that do not fit the base model. Tensors are in the model's dtype.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF projection -> (our fused projection, slice index within it).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the problem."""


@dataclass(frozen=True)
class ProjectionShape:
    in_features: int
    slice_sizes: tuple[int, ...]  # output rows of each slice, in fused order

    @property
    def out_features(self) -> int:
        return sum(self.slice_sizes)

    def slice_offset(self, index: int) -> int:
        return sum(self.slice_sizes[:index])


def projection_shapes(config: ModelConfig) -> dict[str, ProjectionShape]:
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv_proj": ProjectionShape(hidden, (config.q_size, config.kv_size, config.kv_size)),
        "o_proj": ProjectionShape(config.q_size, (hidden,)),
        "gate_up_proj": ProjectionShape(hidden, (inter, inter)),
        "down_proj": ProjectionShape(inter, (hidden,)),
    }


SliceWeights = tuple[torch.Tensor, torch.Tensor]  # (A [r, in], scaled B [out_slice, r])


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest module rank
    weights: dict[tuple[int, str], tuple[SliceWeights | None, ...]]

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for slices in self.weights.values()
            for pair in slices
            if pair is not None
            for a, b in [pair]
        )


def load_peft_adapter(
    name: str, path: str | Path, config: ModelConfig, max_lora_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Load and validate the PEFT adapter at `path` for the base model `config`."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {str(path)!r} is not a directory")
    peft_config = _read_config(name, directory)
    scaling = _scaling_rule(name, peft_config)
    tensors = _read_tensors(name, directory)
    shapes = projection_shapes(config)
    pairs = _pair_tensors(name, tensors, config.num_hidden_layers)
    weights: dict[tuple[int, str], list[SliceWeights | None]] = {}
    max_rank = 0
    for (layer, hf_proj), (a, b) in sorted(pairs.items()):
        projection, index = TARGETS[hf_proj]
        shape = shapes[projection]
        rank = _check_pair(name, layer, hf_proj, a, b, shape, index, max_lora_rank)
        max_rank = max(max_rank, rank)
        slices = weights.setdefault((layer, projection), [None] * len(shape.slice_sizes))
        scaled_b = (b.to(torch.float32) * scaling(rank)).to(dtype)
        slices[index] = (a.to(dtype).contiguous(), scaled_b.contiguous())
    return LoRAAdapter(
        name, str(directory), max_rank, {key: tuple(value) for key, value in weights.items()}
    )


def _read_config(name: str, directory: Path) -> dict[str, Any]:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: missing {CONFIG_FILE} in {directory}")
    try:
        with file.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: unreadable {CONFIG_FILE}: {exc}") from exc
    if not isinstance(data, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    _check_supported_features(name, data)
    return data


def _check_supported_features(name: str, data: dict[str, Any]) -> None:
    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    unsupported = {
        "use_dora": bool(data.get("use_dora")),
        "fan_in_fan_out": bool(data.get("fan_in_fan_out")),
        "lora_bias": bool(data.get("lora_bias")),
        "modules_to_save": bool(data.get("modules_to_save")),
        "alpha_pattern": bool(data.get("alpha_pattern")),
        "layer_replication": bool(data.get("layer_replication")),
    }
    if data.get("bias", "none") != "none":
        unsupported["bias"] = True
    bad = sorted(key for key, used in unsupported.items() if used)
    if bad:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: unsupported PEFT option(s) {', '.join(bad)}"
        )
    targets = data.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(str(t) for t in targets if str(t).split(".")[-1] not in TARGETS)
        if unknown:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: unsupported target module(s) {', '.join(unknown)}; "
                f"supported: {', '.join(TARGETS)}"
            )


def _scaling_rule(name: str, data: dict[str, Any]) -> Any:
    alpha = data.get("lora_alpha", data.get("r", 8))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha must be > 0, got {alpha!r}")
    use_rslora = bool(data.get("use_rslora", False))

    def scaling(rank: int) -> float:
        return float(alpha) / (math.sqrt(rank) if use_rslora else rank)

    return scaling


def _read_tensors(name: str, directory: Path) -> dict[str, torch.Tensor]:
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        legacy = (directory / "adapter_model.bin").exists()
        other = " (adapter_model.bin is not supported: save with safetensors)" if legacy else ""
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: missing {WEIGHTS_FILE} in {directory}{other}"
        )
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types
        raise LoRAAdapterError(f"LoRA adapter {name!r}: unreadable {WEIGHTS_FILE}: {exc}") from exc


def _pair_tensors(
    name: str, tensors: dict[str, torch.Tensor], num_layers: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: unsupported module tensor {key!r}")
        layer = int(match.group(1))
        if layer >= num_layers:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: tensor {key!r} names layer {layer} but the base "
                f"model has {num_layers} layers"
            )
        halves.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    if not halves:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for (layer, proj), half in halves.items():
        if set(half) != {"A", "B"}:
            missing = "lora_B" if "A" in half else "lora_A"
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layers.{layer}.{proj} has no {missing} weight"
            )
        pairs[(layer, proj)] = (half["A"], half["B"])
    return pairs


def _check_pair(
    name: str,
    layer: int,
    hf_proj: str,
    a: torch.Tensor,
    b: torch.Tensor,
    shape: ProjectionShape,
    index: int,
    max_lora_rank: int,
) -> int:
    where = f"LoRA adapter {name!r}: layers.{layer}.{hf_proj}"
    if a.dim() != 2 or b.dim() != 2:
        raise LoRAAdapterError(f"{where}: lora_A and lora_B must be matrices")
    rank = a.shape[0]
    if rank < 1:
        raise LoRAAdapterError(f"{where}: rank must be at least 1")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{where}: rank {rank} exceeds max_lora_rank ({max_lora_rank})")
    expected_a = (rank, shape.in_features)
    expected_b = (shape.slice_sizes[index], rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise LoRAAdapterError(
            f"{where}: shapes lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not fit the "
            f"base model (expected {expected_a} and {expected_b})"
        )
    return rank
