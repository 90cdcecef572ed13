"""Reading a GGUF file: its tensors (raw, still quantized), a Hugging Face-style config from
its metadata, and a companion directory holding what the engine reads besides weights.

The companion directory (`$KVFLEET_CACHE_DIR/gguf/<name>-<key>/`, key = the file's path, size
and mtime) holds config.json (from the GGUF metadata), the tokenizer transformers builds from
the GGUF (tokenizer.json, tokenizer_config.json with the chat template) and
generation_config.json: the engine's tokenizer and stop ids come from there, the weights
always from the GGUF itself. It is built once, in a temporary sibling renamed into place, so a
directory that exists is complete.

Only the llama architecture (Llama, SmolLM2, Mistral-style GGUFs) is mapped; others raise
ValueError naming the architecture.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from engine.quant.qlinear import QuantTensor

_MARKER = ".kvfleet-gguf.json"
_VERSION = 1


def is_gguf(model: str | Path) -> bool:
    return str(model).endswith(".gguf") and Path(model).is_file()


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and string metadata (token lists are left out: the tokenizer reads those)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type")):
            continue
        out[key] = field.contents()
    return out


def config_dict(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A config.json for engine.models.config.ModelConfig from llama GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: 'llama'")
    if meta.get("llama.rope.scaling.type", "none") not in ("none", "linear") or meta.get(
            "llama.rope.scaling.factor", 1.0) != 1.0:
        raise ValueError("unsupported GGUF RoPE scaling")
    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "vocab_size": int(meta.get("llama.vocab_size") or 0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        # Dequantized values (fp16 scale * q + min) are exact in float32, not in bfloat16.
        "dtype": "float32",
    }
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{theirs}")
        if value is not None:
            config[ours] = int(value)
    return config


def iter_tensors(reader: GGUFReader) -> Iterator[tuple[str, QuantTensor]]:
    """Every tensor as uint8 rows (copied out of the file's memory map), shape [N, K] logical
    (GGUF lists dimensions innermost first)."""
    for t in reader.tensors:
        dims = [int(d) for d in t.shape]
        k = dims[0]
        n = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(n, -1))
        yield t.name, QuantTensor(raw, int(t.tensor_type), k)


def _key(path: Path) -> str:
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def companion_dir(path: str | Path) -> Path:
    """The directory with config.json, tokenizer and generation config for GGUF `path`."""
    path = Path(path)
    root = os.environ.get("KVFLEET_CACHE_DIR") or str(Path.home() / ".cache" / "kvfleet")
    target = Path(root) / "gguf" / f"{path.stem}-{_key(path)}"
    if (target / _MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_companion(path, staging)
        staging.chmod(0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / _MARKER).is_file():  # lost a race to a complete copy: fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_companion(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    from engine.models.default_model import _save_tokenizer

    reader = GGUFReader(str(path))
    config = config_dict(metadata(reader), {t.name for t in reader.tensors})
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not config["vocab_size"]:
        config["vocab_size"] = len(tokenizer)
    _save_tokenizer(tokenizer, out, config["max_position_embeddings"])
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if k in config}
    for name, data in (("config.json", config), ("generation_config.json", generation),
                       (_MARKER, {"version": _VERSION, "source": str(path)})):
        (out / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
