"""The decoder layer's elementwise steps, fused (C++ CPU kernels) or in plain PyTorch.

Both paths compute the same math in the same order as transformers: the residual stream is
updated in place (`residual += x`, the same add as `h + x`), then RMSNorm in float32.
The PyTorch path is op-for-op transformers' and is used for float16, for devices other than
CPU, and wherever the kernels could not be built; the fused path makes one pass per row
instead of several passes over the whole batch, for float32 and bfloat16.

The Gemma and q/k-norm steps (`gemma_norm`, `gemma_add_norm`, `gelu_and_mul`,
`qk_norm_rotary`) follow the same rule with kernels/cpu/fused_gemma*.cpp.

Invariant: in bfloat16 the fused path is bit-identical to the PyTorch path (the kernels round
to bf16 wherever one of its ops would, and sum in ATen's order; tests/engine/test_cpu_kernels.py
and tests/engine/test_gemma_kernels.py hold them to it). In float32 it agrees to float
rounding (fast-math kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.norms import RMSNorm, gemma_norm_math
from engine.models.rope import apply_rotary

# The dtypes the C++ kernels are built for; others take the PyTorch path even when fused.
FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _split_qkv_heads(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, KVH, D] as views of fused qkv [T, (H + 2 KVH) * D]."""
    # One view and one split give the strides three splits and views would, in ~1/4 of the
    # Python time (this glue ran ~10 us a layer against the RoPE kernel's ~2.5).
    q, k, v = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, head_dim).split_with_sizes(
        [num_heads, num_kv_heads, num_kv_heads], dim=1)
    return q, k, v


class LayerOps:
    def __init__(self, fused: bool = False) -> None:
        self.fused = fused

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.fused and x.dtype in FUSED_DTYPES:
            # The op allocates its output (and makes x contiguous): ~1 us a call less.
            out: torch.Tensor = torch.ops.kvfleet_cpu.rms_norm.default(x, weight, eps)
            return out
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x (in place); returns rms_norm(residual) * weight."""
        if self.fused and x.dtype in FUSED_DTYPES:
            out: torch.Tensor = torch.ops.kvfleet_cpu.add_rms_norm.default(
                x, residual, weight, eps)
            return out
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused and gate_up.dtype in FUSED_DTYPES:
            out: torch.Tensor = torch.ops.kvfleet_cpu.silu_and_mul.default(gate_up)
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_qkv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,  # [T, 1, head_dim / 2]
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split fused qkv [T, (H + 2 KVH) * D] into rotated q, rotated k, and v."""
        t = qkv.shape[0]
        if self.fused and qkv.dtype in FUSED_DTYPES:
            # The kernel reads cos/sin [T, 1, D/2] (contiguous) as [T, D/2]: no per-layer slice.
            torch.ops.kvfleet_cpu.rotary_qk.default(
                qkv, num_heads, num_kv_heads, head_dim, cos, sin)
            return _split_qkv_heads(qkv, num_heads, num_kv_heads, head_dim)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (
            apply_rotary(q.view(t, num_heads, head_dim), cos, sin),
            apply_rotary(k.view(t, num_kv_heads, head_dim), cos, sin),
            v.view(t, num_kv_heads, head_dim),
        )

    def rotary_qkv_write_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,  # [T, 1, head_dim / 2]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`rotary_qkv` that also writes the rotated k and v rows to their cache slots, the
        write the attention call would do (one C++ call a layer instead of two); None, with
        nothing done, where the fused ops do not apply (the caller then takes `rotary_qkv`)."""
        if not (self.fused and qkv.dtype in FUSED_DTYPES and kv_cache.dtype == qkv.dtype):
            return None
        torch.ops.kvfleet_cpu.rotary_qk_write_kv.default(
            qkv, num_heads, num_kv_heads, head_dim, cos, sin, kv_cache, slot_mapping)
        return _split_qkv_heads(qkv, num_heads, num_kv_heads, head_dim)

    def gemma_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: rmsnorm(x) * (1 + weight) in float32, cast once."""
        if self._fuses(x):
            out = torch.empty_like(x)
            torch.ops.kvfleet_cpu.gemma_rms_norm.default(
                out, x.contiguous(), None, weight, weight, eps)
            return out
        return gemma_norm_math(x, weight, eps)

    def gemma_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, nxt: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """residual += gemma_norm(x, post) (in place); returns gemma_norm(residual, nxt): a
        block's post norm, the residual add and the next norm (Gemma's layer layout)."""
        if self._fuses(x):
            out = torch.empty_like(x)
            torch.ops.kvfleet_cpu.gemma_rms_norm.default(
                out, x.contiguous(), residual, post, nxt, eps)
            return out
        residual.add_(gemma_norm_math(x, post, eps))
        return gemma_norm_math(residual, nxt, eps)

    def gelu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU: gelu_tanh(gate) * up for gate_up [T, 2I]."""
        if self._fuses(gate_up):
            out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            torch.ops.kvfleet_cpu.gelu_tanh_and_mul.default(out, gate_up.contiguous())
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def qk_norm_rotary(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        norms: tuple[RMSNorm, RMSNorm, bool],  # q_norm, k_norm, Gemma numerics
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`rotary_qkv` after each q and k head's own norm, in place on qkv; None where the
        kernels do not apply (the caller takes the PyTorch route)."""
        if not self._fuses(qkv) or qkv.stride(-1) != 1:
            return None
        q_norm, k_norm, gemma = norms
        torch.ops.kvfleet_cpu.qk_norm_rotary.default(
            qkv, num_heads, num_kv_heads, head_dim, q_norm.weight, k_norm.weight, q_norm.eps,
            gemma, cos[:, 0], sin[:, 0])
        t, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
                v.view(t, num_kv_heads, head_dim))

    def _fuses(self, x: torch.Tensor) -> bool:
        return self.fused and x.dtype in FUSED_DTYPES and x.device.type == "cpu"
