"""Chooses compiled or interpreted Triton once per process, before any kernel is imported.

Triton reads its interpreter switch when `@triton.jit` decorates a function, i.e. when a
kernel module is imported. `load(interpret=...)` therefore sets the switch first and then
imports the kernel modules; asking later for the other mode is an error rather than a silent
mix of compiled and interpreted kernels. The engine calls `load` at start-up from its config
(interpreted exactly when it runs the Triton backend on CPU); nothing reads the environment at
import time here. A test run may also set `TRITON_INTERPRET=1` itself before importing the
kernels (tests/kernels_triton/conftest.py does, when there is no GPU), which Triton honours.

`launch_counts` counts wrapper launches per kernel name, so tests can assert that a code path
really went through the Triton kernels rather than a PyTorch fallback.
"""

from __future__ import annotations

import importlib
import threading
from collections import Counter
from types import ModuleType

KERNEL_MODULES = (
    "kv_write", "unified_attention", "rms_norm", "rotary", "silu_and_mul", "lora", "fused_moe",
    "w4a16",
)

launch_counts: Counter[str] = Counter()
_lock = threading.Lock()


def count_launch(name: str) -> None:
    launch_counts[name] += 1


def is_interpreted(kernel: object) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def load(interpret: bool) -> dict[str, ModuleType]:
    """Import every kernel module in the requested mode; returns them by name.

    Raises RuntimeError when the kernels were already imported in the other mode (a process
    cannot hold both), or when Triton is not installed.
    """
    with _lock:
        try:
            import triton
        except ImportError as exc:  # pragma: no cover - triton is a pinned dependency
            raise RuntimeError("the Triton backend needs the `triton` package") from exc
        if interpret:
            # Setting the knob also exports TRITON_INTERPRET=1 for Triton's own later reads.
            triton.knobs.runtime.interpret = True
        modules = {
            name: importlib.import_module(f"kernels.triton.{name}") for name in KERNEL_MODULES
        }
        probe = modules["kv_write"].kv_write_kernel
        if is_interpreted(probe) != interpret:
            mode = "interpreted" if is_interpreted(probe) else "compiled"
            raise RuntimeError(
                f"Triton kernels were already imported {mode} in this process; "
                "the interpreter choice must be made before the first kernel import"
            )
        return modules
