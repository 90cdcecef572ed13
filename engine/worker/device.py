"""Where the engine computes, resolved once at start-up from `EngineConfig.device`.

`device` is "auto" (CUDA when `torch.cuda.is_available()`, else CPU), "cpu", "cuda" or
"cuda:N". `resolve_device` turns it into a `torch.device`, raising `DeviceUnavailableError`
(a ValueError, so the services report it as a configuration error) with a message that says
what is missing when CUDA is asked for and not there. `resolve_attention_backend` maps the
configured attention backend onto the device: "auto" is Triton on CUDA and the CPU choice
(compiled C++ kernels, else PyTorch) on CPU; "triton" also runs on CPU, interpreted (tests);
the CPU-only backends are refused on CUDA. On CUDA the engine places weights, KV cache, inputs
and sampling on the device (engine.core.llm_engine, engine.worker.model_runner).

Invariant: nothing here reads the environment or touches CUDA at import time.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
CPU_ONLY_BACKENDS = ("cpu_kernel", "torch")


class DeviceUnavailableError(ValueError):
    """The configured device does not exist on this machine."""


def validate_device_spec(spec: str) -> None:
    if not DEVICE_SPEC.match(spec):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {spec!r}")


def resolve_device(
    spec: str,
    cuda_available: Callable[[], bool] | None = None,
    cuda_count: Callable[[], int] | None = None,
) -> torch.device:
    """The configured device; tests inject `cuda_available`/`cuda_count`."""
    validate_device_spec(spec)
    cuda_available = cuda_available or torch.cuda.is_available
    cuda_count = cuda_count or torch.cuda.device_count
    if spec == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not cuda_available():
        build = torch.version.cuda or "none (a CPU-only build)"
        raise DeviceUnavailableError(
            f"device {spec!r} was requested but no CUDA GPU is visible to this process "
            f"(torch {torch.__version__}, CUDA runtime {build}); install a CUDA build of torch "
            "on a machine with a GPU, or run with --device cpu"
        )
    device = torch.device(spec)
    if device.index is not None and device.index >= cuda_count():
        raise DeviceUnavailableError(
            f"device {spec!r} was requested but only {cuda_count()} CUDA device(s) are visible"
        )
    return device


def resolve_attention_backend(requested: str, device: torch.device) -> str:
    """The backend the model runner uses: "triton", or a CPU choice ("auto"/"cpu_kernel"/"torch")
    that the runner refines by whether the C++ kernels build."""
    if device.type == "cuda":
        if requested in CPU_ONLY_BACKENDS:
            raise ValueError(
                f"attention_backend={requested!r} is a CPU path; on {device} use auto or triton"
            )
        return "triton"
    return requested
