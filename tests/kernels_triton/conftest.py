"""The Triton kernel tier: interpreted on CPU (TRITON_INTERPRET=1), compiled on a GPU.

Triton decides interpreted-or-compiled when `@triton.jit` runs, i.e. when a kernel module is
imported. pytest imports this conftest before any test module of this directory, so setting
the switch here (only when there is no GPU) precedes every kernel import of the tier. On a
GPU machine the same tests run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"



@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="session", autouse=True)
def kernels_in_expected_mode() -> None:
    """Fail loudly (instead of crashing inside Triton) if a kernel was imported too early."""
    from kernels.triton import runtime

    runtime.load(interpret=not HAS_CUDA)
