"""Repacking an AWQ/GPTQ int4 weight, once at load, into GGUF Q4_1 rows for the CPU kernels.

Q4_1 holds 32 weights along K a block as 4-bit codes with an fp16 scale d and minimum m,
weight = d * q + m computed in float32 (engine.quant.formats, the kernels alike). An int4
group of `group_size` (a multiple of 32) becomes group_size / 32 blocks, each with d = s and
m = fp16(-z * s) and the codes q unchanged.

Exactness against the checkpoint's own dequantization (q - z) * s in float32: d * q is exact
(a 4-bit integer times an fp16), and so is d * q + m whenever m equals -z * s exactly, i.e.
whenever z * s is representable in fp16 — always for a zero of 0, 1, 2, 4 or 8 (GPTQ's
symmetric checkpoints store z = 8), and for any zero whose product with the scale needs at
most 11 significant bits. Otherwise the stored minimum is -z * s rounded to fp16, and every
weight of that group differs from (q - z) * s by exactly that rounding (at most 2^-11 |z s|,
so at most |s| / 128): `zero_term_error` gives it, and tests/engine/test_awq_gptq.py checks
the difference equals it element for element.
"""

from __future__ import annotations

import torch

from engine.quant import formats
from engine.quant.int4_unpack import Int4Weight
from engine.quant.qlinear import QuantTensor

_BLOCK = 32


def _minimums(w: Int4Weight) -> torch.Tensor:
    """fp16 [groups, out]: -z * s (exact in float32) rounded to fp16."""
    return (-(w.z.float() * w.s.float())).to(torch.float16)


def zero_term_error(w: Int4Weight) -> torch.Tensor:
    """float32 [groups, out]: Q4_1's weight minus the checkpoint's, the same for every weight
    of a group (zero where z * s is an fp16)."""
    return _minimums(w).float() + w.z.float() * w.s.float()


def to_q4_1(w: Int4Weight) -> QuantTensor:
    """Q4_1 rows [out, in / 32 * 20] of `w` (engine.quant.formats' layout)."""
    k, n = w.q.shape
    if w.group_size % _BLOCK or k % _BLOCK:
        raise ValueError(f"int4 groups of {w.group_size} over {k} inputs do not split into "
                         f"blocks of {_BLOCK}")
    per_group = w.group_size // _BLOCK
    codes = w.q.T.reshape(n, k // _BLOCK, _BLOCK)
    # ggml's order: byte j holds weight j in its low nibble and weight j + 16 in its high.
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    d = w.s.T.repeat_interleave(per_group, dim=1).contiguous()
    m = _minimums(w).T.repeat_interleave(per_group, dim=1).contiguous()
    header = torch.stack([d, m], dim=-1).view(torch.uint8)  # [n, blocks, 4]
    raw = torch.cat([header, packed], dim=-1).reshape(n, -1).contiguous()
    assert raw.shape[1] == formats.row_bytes(formats.Q4_1, k)
    return QuantTensor(raw, formats.Q4_1, k)
