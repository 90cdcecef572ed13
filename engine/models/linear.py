"""A Linear layer that uses an MKL-prepacked copy of its weight for small batches.

Decode steps multiply a few dozen rows by each weight; there MKL's packed GEMM is markedly
faster than the default path on CPU (the weight's blocking is done once at load, not per call),
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


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None

    def prepack(self) -> None:
        if (
            self.weight.dtype == torch.float32
            and self.weight.device.type == "cpu"
            and torch.backends.mkl.is_available()
        ):
            self.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(
                self.weight.detach(), _PACK_HINT_ROWS
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and 0 < x.shape[0] <= PACKED_MAX_ROWS:
            return torch.ops.mkl._mkl_linear(
                x, self.packed_weight, self.weight, self.bias, _PACK_HINT_ROWS
            )
        return F.linear(x, self.weight, self.bias)


def prepack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack()
