"""Builds and loads the GGUF quantized-GEMM kernels (`torch.ops.kvfleet_quant.*`) on first use:
quant_gemm.cpp (Q8_0, Q4_0, Q4_1), quant_panel.cpp, quant_panel_q4p.cpp (panel-ordered Q4)
and kquant_gemm.cpp (Q5_0, Q4_K, Q5_K, Q6_K), one library.

A library of its own beside `kernels.cpu`'s: editing this kernel rebuilds only it, and the
quantized path can be missing (no compiler) while the other CPU ops work, or the reverse.
Built and cached exactly as `kernels.cpu` builds its ops (same flags, same cache key rules,
same atomic rename); callers fall back to dequantize-then-matmul when `load()` is False.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from kernels.cpu import _build_dir, _load_or_build

logger = logging.getLogger("kvfleet.kernels")

# One source a line (headers: quant_blocks.h, quant_panel*.h, ../simd.h, ../panel_layout.h).
_SOURCES = [
    Path(__file__).with_name("quant_gemm.cpp"),
    Path(__file__).with_name("quant_panel.cpp"),
    Path(__file__).with_name("kquant_gemm.cpp"),
    Path(__file__).with_name("quant_panel_q4p.cpp"),
]
# Part of the build's cache key: kernels.cpu hashes only its own directory's headers (../simd.h
# and ../panel_layout.h among them), not these.
_HEADERS = [Path(__file__).with_name(h)
            for h in ("quant_blocks.h", "quant_gemv_bf16.h", "quant_panel.h",
                      "quant_panel_bf16.h", "quant_panel_q4f.h", "quant_panel_q4p.h")]
_NAME = "kvfleet_quant_ops"
_lock = threading.Lock()
_state: dict[str, bool] = {}


def load() -> bool:
    """Compile (once per machine) and load the quantized GEMM; True when it is usable."""
    with _lock:
        if "loaded" not in _state:
            try:
                _load_or_build(_build_dir([*_SOURCES, *_HEADERS]), _NAME, _SOURCES)
                _state["loaded"] = all(hasattr(torch.ops.kvfleet_quant, op) for op in (
                    "quant_linear", "quant_linear_panel", "kquant_linear"))
            except Exception as exc:  # noqa: BLE001 - any build failure means "use the fallback"
                logger.warning("quantized GEMM kernel unavailable, dequantizing instead: %s", exc)
                _state["loaded"] = False
        return _state["loaded"]
