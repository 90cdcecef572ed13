"""Reading a GGUF file: its tensors (raw, still quantized), a Hugging Face-style config from
its metadata, and a companion directory holding what the engine reads besides weights.

The companion directory (`$KVFLEET_CACHE_DIR/gguf/<name>-<key>/`, key = the file's path, size
and mtime) holds config.json (from the GGUF metadata), the tokenizer transformers builds from
the GGUF (tokenizer.json, tokenizer_config.json with the chat template) and
generation_config.json: the engine's tokenizer and stop ids come from there, the weights
always from the GGUF itself. It is built once, in a temporary sibling renamed into place, so a
directory that exists is complete.

The architectures mapped (llama, gemma3) and their config are engine.quant.gguf_arch's; others
raise ValueError naming the architecture. A file without `tokenizer.chat_template` (Gemma 3
270M's) gets a tokenizer without one: completions work, chat needs `--chat-template`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from engine.quant.gguf_arch import arch_of
from engine.quant.qlinear import QuantTensor

logger = logging.getLogger("kvfleet.engine")

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
    """A config.json for engine.models.config.ModelConfig from the file's metadata."""
    return arch_of(meta.get("general.architecture")).config(meta, tensor_names)


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
    if tokenizer.chat_template is None:
        logger.warning("GGUF %s has no chat template: chat requests need --chat-template",
                       path.name)
    _save_tokenizer(tokenizer, out, config["max_position_embeddings"],
                    require_chat_template=False)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if k in config}
    for name, data in (("config.json", config), ("generation_config.json", generation),
                       (_MARKER, {"version": _VERSION, "source": str(path)})):
        (out / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
