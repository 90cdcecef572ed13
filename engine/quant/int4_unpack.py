"""Unpacking AWQ and GPTQ int4 tensors into plain codes, zeros and scales.

Both formats pack eight 4-bit values into an int32, value i at bits 4i..4i+3. GPTQ packs its
qweight along the input dimension ([in/8, out]: input row 8r + i at nibble i) and its qzeros
along the output dimension in order; AWQ packs both along the output dimension with its
interleaved order: output column 8c + j sits at nibble REVERSE[j] (AWQ's packer writes columns
0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7).

Result of both: `Int4Weight` with q uint8 [in, out] (0..15), z uint8 [groups, out] (the true
zero point, GPTQ's offset applied: 0..16) and s [groups, out] as stored (fp16), so the
checkpoint's own dequantization is (q - z) * s with input row r in group r // group_size.

Invariants: shapes are checked against each other (ValueError naming the tensor); a GPTQ g_idx
other than the plain order r // group_size (act-order) is refused naming g_idx.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.prequant_config import PrequantConfig

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class Int4Weight:
    """One projection's int4 weight: q [in, out], z and s [groups, out]; x @ W is
    x @ ((q - z) * s) with row r of q in group r // group_size."""

    q: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor
    group_size: int

    @property
    def in_features(self) -> int:
        return int(self.q.shape[0])

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the checkpoint's (q - z) * s (exact in float32: a small integer
        times an fp16 scale)."""
        z = self.z.repeat_interleave(self.group_size, dim=0).float()
        s = self.s.repeat_interleave(self.group_size, dim=0).float()
        return ((self.q.float() - z) * s).T.contiguous()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [a, b] -> uint8 [a, b, 8], nibble i of each int32 at index i."""
    return ((packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8)


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {shape}")


def unpack_int4(prefix: str, tensors: dict[str, torch.Tensor],
                config: PrequantConfig) -> Int4Weight:
    """The projection `prefix` (e.g. model.layers.0.self_attn.q_proj) of an AWQ/GPTQ
    checkpoint from its `qweight`, `qzeros`, `scales` (and GPTQ's optional `g_idx`)."""
    missing = [n for n in ("qweight", "qzeros", "scales") if n not in tensors]
    if missing:
        raise ValueError(f"{prefix}: missing {', '.join(missing)}")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    out = int(scales.shape[1])
    if config.method == "awq":
        in_features = int(qweight.shape[0])
        order = list(AWQ_REVERSE_ORDER)
        q = _nibbles(qweight)[..., order].reshape(in_features, -1)
        z = _nibbles(qzeros)[..., order].reshape(qzeros.shape[0], -1)
    else:
        in_features = int(qweight.shape[0]) * 8
        q = _nibbles(qweight.T).reshape(out, in_features).T.contiguous()
        z = _nibbles(qzeros).reshape(qzeros.shape[0], -1) + config.zero_offset
    group = in_features if config.group_size == -1 else config.group_size
    if in_features % group:
        raise ValueError(f"{prefix}: {in_features} input features are not a whole number of "
                         f"groups of {group} (quantization_config.group_size)")
    groups = in_features // group
    _check(f"{prefix}.qweight", q, (in_features, out))
    _check(f"{prefix}.qzeros", z, (groups, out))
    _check(f"{prefix}.scales", scales, (groups, out))
    if scales.dtype != torch.float16:
        raise ValueError(f"{prefix}.scales: dtype {scales.dtype}, expected torch.float16 (the "
                         "CPU blocks hold fp16 scales)")
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        plain = torch.arange(in_features, dtype=torch.int64) // group
        if g_idx.shape != plain.shape or not torch.equal(g_idx.to(torch.int64), plain):
            raise ValueError(f"{prefix}.g_idx: act-order (quantization_config.desc_act) with a "
                             "permuted g_idx is not supported; re-quantize with desc_act=false")
    return Int4Weight(q, z.to(torch.uint8), scales, group)
