"""RMSNorm weights and the two numerics transformers uses for them.

Llama's (`RMSNorm`, math in `LayerOps`, fused or not): normalise in float32, cast to the
activation dtype, then `weight * x`. Gemma's (`GemmaRMSNorm`): normalise in float32, multiply
by `(1 + weight)` in float32, then cast (transformers' Gemma2RMSNorm / Gemma3RMSNorm; the
checkpoint stores w, not 1 + w). Both also serve as per-head q/k norms (Qwen3, Gemma 3),
applied over the last dimension of [T, heads, head_dim].
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm weights; the math lives in `LayerOps` (fused or not)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch math over the last dimension (used for per-head q/k norms)."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_norm_math(x, self.weight, self.eps)


def gemma_norm_math(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm over the last dimension, op for op."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)
