"""Builds and loads the C++ CPU kernels (`torch.ops.kvfleet_cpu.*`) on first use.

The build is cached under the kvfleet cache directory, keyed by the source, the compiler flags
and the CPU's feature flags (the code is compiled with -march=native, so a cache shared between
different CPUs must not hand one machine another's binary). If anything fails — no compiler, no
ninja — `load()` returns False and callers use the PyTorch fallback.

No lock is shared between processes: each builder compiles in a private directory and renames
the finished library into place (atomic), and a process finding it there just loads it. A
builder killed mid-build (an engine kill -9'd during its first start) therefore leaves only
an unused directory behind, never a lock file that every later engine would wait on forever
(torch's own build lock has no owner check).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger("kvfleet.kernels")

_SOURCES = [
    Path(__file__).with_name("paged_decode_attention.cpp"),
    Path(__file__).with_name("paged_prefill_attention.cpp"),
    Path(__file__).with_name("kv_cache_write.cpp"),
    Path(__file__).with_name("fused_elementwise.cpp"),
    Path(__file__).with_name("fused_elementwise_bf16.cpp"),
    Path(__file__).with_name("fused_gemma.cpp"),
    Path(__file__).with_name("fused_gemma_bf16.cpp"),
    Path(__file__).with_name("panel_linear.cpp"),
    Path(__file__).with_name("amx_linear.cpp"),
    Path(__file__).with_name("lora_delta.cpp"),
    Path(__file__).with_name("greedy_screen.cpp"),
    Path(__file__).with_name("fused_moe.cpp"),
    Path(__file__).with_name("fused_moe_panel.cpp"),
]
# -ffast-math lets GCC vectorise expf through glibc's libmvec; the kernels never rely on
# infinities or NaNs. -fopenmp makes at::parallel_for (an inline OpenMP loop in the ATen
# headers) really parallel in our code; without it every kernel runs on one core. torch
# ships GNU OpenMP too, so both resolve to the one libgomp already loaded.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_NAME = "kvfleet_cpu_ops"
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_fingerprint() -> str:
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = "unknown"
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def _build_dir(sources: list[Path] | None = None) -> Path:
    root = os.environ.get("KVFLEET_CACHE_DIR") or str(Path.home() / ".cache" / "kvfleet")
    digest = hashlib.sha256(" ".join(_FLAGS).encode())
    # Headers the sources include are part of the key too.
    for source in [*(sources or _SOURCES), *sorted(Path(__file__).parent.glob("*.h"))]:
        digest.update(source.read_bytes())
    key = digest.hexdigest()[:10]
    path = Path(root) / "torch_extensions" / f"{key}-{_cpu_fingerprint()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load() -> bool:
    """Compile (once per machine) and load the CPU ops; True when they are usable."""
    with _lock:
        if "loaded" in _state:
            return _state["loaded"]
        try:
            _load_or_build(_build_dir())
            ok = all(
                hasattr(torch.ops.kvfleet_cpu, op)
                for op in (
                    "paged_decode_attention",
                    "paged_prefill_attention",
                    "write_kv_cache",
                    "rms_norm",
                    "silu_and_mul",
                    "rotary_qk",
                )
            )
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the fallback"
            logger.warning("CPU attention kernel unavailable, using PyTorch fallback: %s", exc)
            ok = False
        _state["loaded"] = ok
        return ok


def _load_or_build(build_dir: Path, name: str = _NAME, sources: list[Path] | None = None) -> None:
    """Load library `name` from `build_dir`, compiling `sources` (default: ours) first if
    needed. Other kernel libraries (kernels.cpu.quant) build through this too."""
    library = build_dir / f"{name}.so"
    if library.is_file():
        torch.ops.load_library(str(library))
        return
    from torch.utils.cpp_extension import load as load_extension

    private = Path(tempfile.mkdtemp(prefix=f"build-{os.getpid()}-", dir=build_dir))
    try:
        load_extension(  # builds and loads the library
            name=name,
            sources=[str(s) for s in (sources or _SOURCES)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(private),
            is_python_module=False,
            verbose=False,
        )
        os.replace(private / f"{name}.so", library)
    finally:
        shutil.rmtree(private, ignore_errors=True)
