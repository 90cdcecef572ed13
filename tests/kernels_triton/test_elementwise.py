"""Fused RMSNorm (+ residual), rotary embedding and SiLU-and-mul vs their PyTorch references.

Shapes: SmolLM2's hidden 576 and intermediate 1536 (not powers of two: masked tails; 1536 also
spans two column programs), plus small odd sizes. Inputs are pre-filled outputs of NaN, so an
unwritten element fails.

Tolerances (|got - want| <= atol + rtol * |want|; values up to ~30 in magnitude):
- float32: 1e-5 both — float32 reduction order (RMSNorm) / exp implementation (SiLU) only.
- float16: rtol 2^-9 (two ulps) — the kernels compute in float32 and round where the
  reference rounds, but the float32 values being rounded differ in their last bits.
- bfloat16: rtol 2^-6 (two ulps) — as float16, and the interpreter's float32->bfloat16 cast
  truncates instead of rounding to nearest (Triton 3.9; compiled kernels round), at each of
  the kernel's two roundings (SiLU, then the product; the residual sum, then the norm).
The residual stream written by the fused add is compared with the same tolerance.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama

from engine.models.config import Llama3RopeScaling
from engine.models.rope import RotaryEmbedding
from kernels.triton import runtime
from kernels.triton.rms_norm import rms_norm, rms_norm_reference
from kernels.triton.rotary import rotary_embedding, rotary_reference
from kernels.triton.silu_and_mul import silu_and_mul, silu_and_mul_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {  # dtype: (atol, rtol)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2.0**-9),
    torch.bfloat16: (1e-2, 2.0**-6),
}


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=atol, rtol=rtol)


def launched(name: str, before: int) -> None:
    assert runtime.launch_counts[name] == before + 1, f"{name} kernel did not run"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [96, 576])
def test_rms_norm(dtype, with_residual, hidden, device):
    gen = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(9, hidden, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(9, hidden, generator=gen).to(dtype) if with_residual else None
    eps = 1e-5
    expected_residual = None if residual is None else residual.clone()
    expected = rms_norm_reference(x, weight, eps, expected_residual)

    out = torch.full((9, hidden), float("nan"), dtype=dtype, device=device)
    got_residual = None if residual is None else residual.to(device, copy=True)
    before = runtime.launch_counts["rms_norm"]
    rms_norm(out, x.to(device), weight.to(device), eps, got_residual)
    launched("rms_norm", before)
    close(out, expected)
    if residual is not None:
        assert got_residual is not None and expected_residual is not None
        close(got_residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [80, 1536])
def test_silu_and_mul(dtype, intermediate, device):
    gen = torch.Generator().manual_seed(intermediate)
    gate_up = (2 * torch.randn(7, 2 * intermediate, generator=gen)).to(dtype)
    out = torch.full((7, intermediate), float("nan"), dtype=dtype, device=device)
    before = runtime.launch_counts["silu_and_mul"]
    silu_and_mul(out, gate_up.to(device))
    launched("silu_and_mul", before)
    close(out, silu_and_mul_reference(gate_up))


def rotate_in_place(qkv, num_heads, num_kv_heads, head_dim, positions, rope, device):
    """Rotate the q and k parts of a fused qkv tensor in place, as the engine would."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    before = runtime.launch_counts["rotary"]
    rotary_embedding(
        q, k, positions.to(device), rope._cos.to(device), rope._sin.to(device)
    )
    launched("rotary", before)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference(dtype, device):
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    gen = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    positions = torch.tensor([0, 1, 15, 16, 17, 200, 511, 3])
    qkv = torch.randn(8, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    value_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    q_size = num_heads * head_dim
    expected_q = rotary_reference(
        qkv[:, :q_size].view(8, num_heads, head_dim), positions, rope._cos, rope._sin
    )
    got = qkv.to(device, copy=True)
    q, k = rotate_in_place(got, num_heads, num_kv_heads, head_dim, positions, rope, device)
    close(q, expected_q)
    expected_k = rotary_reference(
        qkv[:, q_size : q_size + num_kv_heads * head_dim].view(8, num_kv_heads, head_dim),
        positions, rope._cos, rope._sin,
    )
    close(k, expected_k)
    assert torch.equal(got[:, (num_heads + num_kv_heads) * head_dim :].cpu(), value_before)


def test_rotary_llama3_scaling_matches_transformers(device):
    """The llama3 path end to end: the engine's scaled tables + the kernel vs transformers'
    LlamaRotaryEmbedding + apply_rotary_pos_emb (float32)."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    params = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,  # all three bands
    }
    config = transformers.LlamaConfig(
        hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=1024,
        rope_parameters=params,
    )
    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    rope = RotaryEmbedding(head_dim, 1024, 500000.0, scaling)
    positions = torch.tensor([0, 5, 63, 64, 500, 1023])
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(6, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q_size = num_heads * head_dim
    hf_q = qkv[:, :q_size].view(6, num_heads, head_dim).transpose(0, 1).unsqueeze(0)
    hf_k = qkv[:, q_size : q_size + num_kv_heads * head_dim].view(6, num_kv_heads, head_dim)
    hf_k = hf_k.transpose(0, 1).unsqueeze(0)
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(hf_q, positions.unsqueeze(0))
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(hf_q, hf_k, cos, sin)

    got = qkv.to(device, copy=True)
    q, k = rotate_in_place(got, num_heads, num_kv_heads, head_dim, positions, rope, device)
    torch.testing.assert_close(q.cpu(), want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.cpu(), want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
