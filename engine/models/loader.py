"""Build a model from a Hugging Face directory: config.json + *.safetensors.

Invariants: the returned model is in eval mode, every parameter has requires_grad=False and
the requested dtype, and every parameter was loaded from the checkpoint (the model is built
on the meta device, so nothing is randomly initialised or silently left at its init value).
Sharded checkpoints are read through model.safetensors.index.json; tensors are streamed one
at a time so peak memory is about the model plus one tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import model_class

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(
    name: str, config: ModelConfig, device: str | torch.device = "cpu"
) -> torch.dtype:
    """Map "auto" | "float32" | "bfloat16" | "float16" to a torch dtype for `device`.

    "auto" takes the checkpoint's dtype (float32 when config.json names none). float16 becomes
    bfloat16 on CPU, where half-precision kernels are slow or missing and bf16's range is safer.
    """
    requested = (config.dtype or "float32") if name == "auto" else name
    if requested not in _DTYPES:
        raise ValueError(f"unsupported dtype {requested!r}; expected one of auto, {list(_DTYPES)}")
    dtype = _DTYPES[requested]
    if dtype == torch.float16 and torch.device(device).type == "cpu":
        return torch.bfloat16
    return dtype


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: from the shard index when present, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with index.open(encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load the model from `model_dir` in `dtype` onto `device`, ready for inference."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    # Cast while still on meta (free), then materialise uninitialised storage: no random
    # init and no transient float32 copy of a bf16 model.
    model = model.to(dtype=dtype).to_empty(device=device)
    model.load_weights(iter_safetensors(safetensors_files(model_dir)))
    model.eval()
    model.requires_grad_(False)
    return model, config
