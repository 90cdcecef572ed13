"""Rotary position embedding, numerically identical to transformers' Llama implementation.

Invariants:
- cos/sin are computed once, in float32 on CPU, for every position < max_positions, exactly
  as transformers computes them (float32 positions times float32 inverse frequencies), then
  cast to the activation dtype at lookup, as transformers casts them to `x.dtype`.
- Only the half-width tables are stored ([max_positions, head_dim / 2]): transformers'
  `cat((freqs, freqs))` duplicates them, and applying the halves separately performs the same
  float operations in the same order as `q * cos + rotate_half(q) * sin`, so results are
  bitwise equal in float32 and bfloat16.
- Lookups are by a `positions` tensor [T] of the flattened batch; no per-token Python.
"""

from __future__ import annotations

import math

import torch

from engine.models.rope_scaling import (
    LinearRopeScaling,
    LongRopeScaling,
    RopeScaling,
    YarnRopeScaling,
    attention_factor,
    longrope_inv_freq,
    yarn_inv_freq,
)


def compute_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] float32, scaled (linear, llama3) as transformers
    does it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, YarnRopeScaling):
        return yarn_inv_freq(head_dim, theta, scaling)
    if isinstance(scaling, LongRopeScaling):
        return longrope_inv_freq(head_dim, theta, scaling.short_factor)
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Cos/sin tables plus the rotation; shared by all layers of one model.

    Deliberately not an `nn.Module` with buffers: buffers would follow `model.to(dtype)` and
    `to_empty()` (meta-device construction), losing the float32 master tables. Converted
    copies are memoized per (device, dtype) instead.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.max_positions = max_positions
        with torch.device("cpu"):  # models are built under torch.device("meta")
            self._build(head_dim, max_positions, theta, scaling)
        self._converted: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}

    def _build(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        inv_freq = compute_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]
        if isinstance(scaling, LongRopeScaling):  # past the original length: long factors
            long = longrope_inv_freq(head_dim, theta, scaling.long_factor)
            past = positions >= scaling.original_max_position_embeddings
            freqs[past] = positions[past, None] * long[None, :]
        # transformers multiplies both by the attention factor (yarn/longrope), 1.0 otherwise.
        factor = attention_factor(scaling)
        self._cos = freqs.cos() * factor
        self._sin = freqs.sin() * factor

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position, shaped [T, 1, head_dim / 2] to broadcast over heads."""
        key = (positions.device, dtype)
        tables = self._converted.get(key)
        if tables is None:
            tables = (
                self._cos.to(device=positions.device, dtype=dtype),
                self._sin.to(device=positions.device, dtype=dtype),
            )
            self._converted[key] = tables
        cos, sin = tables
        return (
            cos.index_select(0, positions).unsqueeze(1),
            sin.index_select(0, positions).unsqueeze(1),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] with half-width cos/sin [T, 1, head_dim / 2].

    Same op order as transformers' `x * cos + rotate_half(x) * sin` with `cat((f, f))` tables:
    first half x1*c + (-x2)*s, second half x2*c + x1*s.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
