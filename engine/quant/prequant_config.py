"""A pre-quantized Hugging Face checkpoint's `quantization_config`: read and checked.

Two methods are read, both 4-bit with a scale and a zero point per group of `group_size` input
features (weight = (q - z) * s):

- `awq` (AutoAWQ, version "gemm"): qweight int32 [in, out/8], qzeros int32 [in/group, out/8],
  both packing 8 output columns an int32 in AWQ's interleaved nibble order; scales fp16
  [in/group, out]. Zeros are stored as they are.
- `gptq` (AutoGPTQ / GPTQModel): qweight int32 [in/8, out] packing 8 input rows an int32 in
  order; qzeros int32 [in/group, out/8] in order; scales [in/group, out]; g_idx int32 [in]
  (each input feature's group). `checkpoint_format` "gptq" (or absent: the original format)
  stores z - 1 (the true zero is the nibble + 1, in 1..16); "gptq_v2" stores z.

Refused, each naming its field: any other quant_method or bits, AWQ versions other than
"gemm" and AWQ without zero points, group sizes that are not -1 (one group per row) or a
multiple of 32 (the CPU blocks' size), a quantized `lm_head`, and `modules_to_not_convert`
(every decoder projection must be quantized). GPTQ act-order (`desc_act`) is accepted only
where the checkpoint's g_idx turns out to be the plain order i // group_size (checked per
tensor at load, engine.quant.int4_unpack).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("awq", "gptq")


@dataclass(frozen=True)
class PrequantConfig:
    method: str  # "awq" | "gptq"
    group_size: int  # -1: one group spanning the whole input dimension
    # Added to the stored zero nibble (1: GPTQ's original format, which stores z - 1).
    zero_offset: int
    desc_act: bool


def _field(name: str) -> str:
    return f"quantization_config.{name}"


def parse_prequant_config(raw: dict[str, Any]) -> PrequantConfig:
    """The checked config of a checkpoint's `quantization_config` dict."""
    method = str(raw.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"{_field('quant_method')} must be one of {', '.join(METHODS)}; "
                         f"got {raw.get('quant_method')!r}")
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{_field('bits')} must be 4 (only 4-bit {method} is supported); "
                         f"got {bits!r}")
    group = raw.get("group_size", raw.get("q_group_size"))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
        raise ValueError(f"{_field('group_size')} must be -1 or a positive multiple of 32; "
                         f"got {group!r}")
    if raw.get("modules_to_not_convert"):
        raise ValueError(f"{_field('modules_to_not_convert')} is not supported (every decoder "
                         f"projection must be quantized); got {raw['modules_to_not_convert']!r}")
    if raw.get("lm_head"):
        raise ValueError(f"{_field('lm_head')}=true is not supported (the LM head must be "
                         "unquantized)")
    if method == "awq":
        return _awq(raw, group)
    return _gptq(raw, group)


def _awq(raw: dict[str, Any], group: int) -> PrequantConfig:
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{_field('version')} must be 'gemm' for awq; got {raw.get('version')!r}")
    if raw.get("zero_point", True) is not True:
        raise ValueError(f"{_field('zero_point')} must be true for awq; "
                         f"got {raw.get('zero_point')!r}")
    return PrequantConfig("awq", group, zero_offset=0, desc_act=False)


def _gptq(raw: dict[str, Any], group: int) -> PrequantConfig:
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{_field('checkpoint_format')} must be 'gptq' or 'gptq_v2'; "
                         f"got {fmt!r}")
    desc_act = raw.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise ValueError(f"{_field('desc_act')} must be true or false; got {desc_act!r}")
    return PrequantConfig("gptq", group, zero_offset=1 if fmt == "gptq" else 0,
                          desc_act=desc_act)
