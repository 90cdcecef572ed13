"""RoPE scaling types, parsed from config.json and applied as transformers does.

Supported `rope_type`s: default, linear (position interpolation), llama3, yarn, and longrope
(Phi-3). Each is a frozen dataclass of plain values; `scaled_inv_freq` turns the default
inverse frequencies into the scaled ones, and `attention_factor` is what transformers
multiplies cos and sin by (yarn's and longrope's mscale; 1.0 for the others).

Invariants: the math is transformers' modeling_rope_utils op for op in float32. Refused with
ValueError: "dynamic" (transformers recomputes its frequencies from each forward pass's
length, so a cached K written at one length would be rotated differently from the query at
another: no fixed table can equal it). Longrope: transformers picks the short or the long
factors for a whole forward pass by its length; here positions below
original_max_position_embeddings use the short factors and positions past it the long ones
(vLLM's rule), so sequences within the original length are exact and longer ones follow
vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1-style frequency-dependent RoPE scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (`rope_type == "linear"`): every inverse frequency / factor."""

    factor: float


@dataclass(frozen=True)
class YarnRopeScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float
    truncate: bool


@dataclass(frozen=True)
class LongRopeScaling:
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling | LongRopeScaling
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def parse_scaling(
    rope_type: str, params: dict[str, Any], original: int, max_positions: int
) -> RopeScaling:
    """The scaling for `rope_type` from its parameters; `original`: the resolved
    original_max_position_embeddings (transformers gives a top-level one priority)."""
    if rope_type == "linear":
        return LinearRopeScaling(factor=float(params["factor"]))
    if rope_type == "llama3":
        return Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    factor = params.get("factor") or max_positions / original
    if rope_type == "yarn":
        return YarnRopeScaling(
            factor=float(factor), original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow")
                                                                           or 1),
            attention_factor=_yarn_attention_factor(params, float(factor)),
            truncate=bool(params.get("truncate", True)),
        )
    if rope_type == "longrope":
        attention = params.get("attention_factor")
        if attention is None:
            attention = (1.0 if factor <= 1.0
                         else math.sqrt(1 + math.log(factor) / math.log(original)))
        return LongRopeScaling(
            short_factor=tuple(float(f) for f in params["short_factor"]),
            long_factor=tuple(float(f) for f in params["long_factor"]),
            original_max_position_embeddings=original, attention_factor=float(attention),
        )
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        + (" (dynamic NTK depends on each forward pass's length)" if rope_type == "dynamic"
           else "")
    )


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"]))
    return mscale(factor)


def attention_factor(scaling: RopeScaling | None) -> float:
    if isinstance(scaling, YarnRopeScaling | LongRopeScaling):
        return scaling.attention_factor
    return 1.0


def yarn_inv_freq(head_dim: int, theta: float, s: YarnRopeScaling) -> torch.Tensor:
    dim = head_dim

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # the extrapolation share per frequency
    return interpolation * (1 - keep) + extrapolation * keep


def longrope_inv_freq(head_dim: int, theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * theta**shape)
