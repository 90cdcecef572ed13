"""Linear layers whose CPU GEMM path is chosen per machine: plain `F.linear`, MKL's packed
GEMM, or oneDNN with the weight reordered once into oneDNN's blocked layout.

Why a choice: the fastest float32 GEMM differs between CPUs. On an AMD EPYC (Zen 4) oneDNN
with a prepacked weight ran the model's shapes at 160-220 GFLOP/s where MKL's paths ran at
55-180 (the LM head at 32 rows: 144 vs 55); on other CPUs MKL can win. `gemm_select` measures
the candidates on the model's own shapes at start-up and the model uses the winner.

Invariants: every backend computes the same float32 (or bfloat16) GEMM `x @ w.T + b`; only the
blocking, hence the last bits of rounding, differ. A layer's dense `weight` parameter stays the
source of truth (loading, state_dict); the packed copy is derived from it by `prepack`.
Packing runs after the weights are loaded and before the first forward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# "dense": F.linear; "mkl": MKL packed GEMM; "onednn": oneDNN with a reordered weight.
BACKENDS = ("dense", "mkl", "onednn")
# The row count the packed layouts are tuned for (a decode batch).
_PACK_HINT_ROWS = 32


def backend_supported(backend: str, dtype: torch.dtype) -> bool:
    if backend == "dense":
        return True
    if backend == "mkl":
        return dtype == torch.float32 and torch.backends.mkl.is_available()
    if backend == "onednn":
        return bool(
            dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled
        )
    raise ValueError(f"unknown linear backend {backend!r}; choose from {', '.join(BACKENDS)}")


def pack_weight(weight: torch.Tensor, backend: str) -> torch.Tensor | None:
    """The backend's packed copy of a CPU [out, in] weight (None for "dense")."""
    w = weight.detach()
    if backend == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(w, _PACK_HINT_ROWS)
    if backend == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS)
    return None


def apply_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str,
    packed: torch.Tensor | None,
) -> torch.Tensor:
    if packed is None or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    if backend == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, _PACK_HINT_ROWS)


class Linear(nn.Linear):
    backend: str = "dense"
    packed_weight: torch.Tensor | None = None

    def prepack(self, backend: str) -> None:
        self.backend = backend
        self.packed_weight = pack_weight(self.weight, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self.weight, self.bias, self.backend, self.packed_weight)


def prepack_linears(model: nn.Module, backend: str) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack(backend)
