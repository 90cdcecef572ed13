"""A Linear layer that uses an MKL-prepacked copy of its weight for small batches.

Decode steps multiply a few dozen rows by each weight (the LM head included); there MKL's
packed GEMM is markedly faster than the default path on CPU (the weight's blocking is done
once at load, not per call),
while large prefill batches are as fast or faster on the default path. Results are the same
float32 GEMM either way. Packing is opt-in (`prepack`), float32 on CPU with MKL only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Batches up to this many rows use the packed weight.
PACKED_MAX_ROWS = 256
_PACK_HINT_ROWS = 32


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL's packed copy of a [out, in] weight, or None where packing does not apply."""
    if (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and torch.backends.mkl.is_available()
    ):
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)
    return None


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, _PACK_HINT_ROWS)


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and 0 < x.shape[0] <= PACKED_MAX_ROWS:
            return packed_linear(x, self.packed_weight, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def prepack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack()
