"""AWQ / GPTQ projections on the Triton path: `W4A16Linear` runs kernels/triton/w4a16.py
(int4 weight dequantized inside the GEMM), and `W4A16LlamaForCausalLM` is the Llama decoder
holding them.

Used where the engine runs its Triton backend: always on CUDA, and on CPU when asked for
(attention_backend="triton", interpreted: how the tests run it). The weights stay 4-bit on
the device: qweight int32 [K/8, N] (8 input rows an int32), fp16 scales and uint8 zeros
[K/G, N]; a fused q/k/v or gate/up projection is its parts side by side along N.

Invariant: the model's prepack packs nothing for the projections (there is no dense weight);
the LM head stays dense (F.linear) and unscreened.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.gemm_select import MAX_PREFILL_ROWS
from engine.models.llama import LlamaForCausalLM
from engine.quant.int4_unpack import Int4Weight
from kernels.triton.w4a16_layout import pack_w4a16


class W4A16Linear(nn.Module):
    """y = x @ ((q - z) * s) (+ bias) by the Triton W4A16 GEMM."""

    # No dense weight: engine.models.llama's gemm_weights skips layers whose weight is None.
    weight = None
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(self, parts: list[Int4Weight], bias: torch.Tensor | None,
                 device: torch.device) -> None:
        super().__init__()
        groups = {p.group_size for p in parts}
        if len(groups) != 1:
            raise ValueError(f"fused int4 parts with different group sizes: {sorted(groups)}")
        self.group_size = groups.pop()
        packed = [pack_w4a16(p.q, p.z, p.s) for p in parts]
        self.register_buffer("qweight", torch.cat([p[0] for p in packed], 1).to(device))
        self.register_buffer("scales", torch.cat([p[1] for p in packed], 1).to(device))
        self.register_buffer("zeros", torch.cat([p[2] for p in packed], 1).to(device))
        self.in_features = parts[0].in_features
        self.out_features = int(self.scales.shape[1])
        self.bias = None if bias is None else nn.Parameter(bias.to(device), requires_grad=False)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.triton.w4a16 import w4a16_linear

        out = w4a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class W4A16LlamaForCausalLM(LlamaForCausalLM):
    """The Llama decoder over W4A16Linear projections."""

    def prepack(self, requested: str = "auto", prefill_rows: int = MAX_PREFILL_ROWS) -> str:
        self._max_batch_rows = prefill_rows
        self._lm_head_backend = "dense"
        self._packed_lm_head = None
        self._greedy_screen = None
        return "w4a16"
