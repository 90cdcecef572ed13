"""The fused Gemma / q-k-norm CPU ops (kernels/cpu/fused_gemma*.cpp) against the PyTorch path
of `LayerOps`: bit for bit in bfloat16, to float rounding in float32. Covers the Gemma norm
alone and with its residual add, GeGLU, and per-head q/k norm + rotation with Llama and Gemma
numerics (strided qkv rows, odd sizes that leave partial vector chunks), and the named errors
for bad input."""

from __future__ import annotations

import pytest
import torch

from engine.models.layer_ops import LayerOps
from engine.models.norms import GemmaRMSNorm, RMSNorm
from engine.models.rope import apply_rotary
from kernels.cpu import load

FUSED, TORCH = LayerOps(fused=True), LayerOps(fused=False)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    assert load(), "the CPU kernels should build on this machine (g++ and ninja are installed)"


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (5, 100)])
def test_gemma_norms_match_pytorch(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    w_post, w_next = (torch.randn(2, hidden, generator=gen) * 0.5).to(dtype)
    same(FUSED.gemma_norm(x, w_post, 1e-6), TORCH.gemma_norm(x, w_post, 1e-6))
    r_fused, r_torch = residual.clone(), residual.clone()
    got = FUSED.gemma_add_norm(x, r_fused, w_post, w_next, 1e-6)
    want = TORCH.gemma_add_norm(x, r_torch, w_post, w_next, 1e-6)
    same(r_fused, r_torch)
    same(got, want)
    assert not torch.equal(r_fused, residual)  # the add happened, in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (19, 1536), (3, 128)])
def test_gelu_and_mul_matches_pytorch(dtype, rows, inter):
    # One thread: ATen's scalar tail loop, run at a thread's range boundary, rounds gelu's
    # far-negative tail differently from its vector loop (fused_gemma_bf16.cpp); sizes here
    # are whole vectors, as the models' intermediate sizes are.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(rows)
        gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
        gate_up[0, :8] = torch.tensor([-30.0, -12.0, -5.0, -0.5, 0.0, 0.5, 5.0, 30.0])
        got = FUSED.gelu_and_mul(gate_up)
        want = TORCH.gelu_and_mul(gate_up)
    finally:
        torch.set_num_threads(threads)
    assert not got.isnan().any()
    same(got, want)


def rope_tables(rows: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = (torch.arange(rows) * 13).float()[:, None] * inv[None]
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 40)])
def test_qk_norm_rotary_matches_norms_then_rotation(dtype, norm_type, heads, kv_heads, dim):
    rows = 7
    gen = torch.Generator().manual_seed(heads * dim)
    q_norm, k_norm = norm_type(dim, 1e-6).to(dtype), norm_type(dim, 1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(dim, generator=gen))
        k_norm.weight.copy_(torch.randn(dim, generator=gen))
    width = (heads + 2 * kv_heads) * dim
    # A column slice of a wider buffer: rows `width + 8` apart.
    qkv = (torch.randn(rows, width + 8, generator=gen) * 2).to(dtype)[:, :width]
    cos, sin = rope_tables(rows, dim, dtype)
    q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    with torch.no_grad():
        want_q = apply_rotary(q_norm.forward(q.reshape(rows, heads, dim)), cos, sin)
        want_k = apply_rotary(k_norm.forward(k.reshape(rows, kv_heads, dim)), cos, sin)
    gemma = norm_type is GemmaRMSNorm
    got = FUSED.qk_norm_rotary(qkv, heads, kv_heads, dim, (q_norm, k_norm, gemma), cos, sin)
    assert got is not None
    same(got[0], want_q)
    same(got[1], want_k)
    assert torch.equal(got[2], v.reshape(rows, kv_heads, dim))
    assert TORCH.qk_norm_rotary(qkv, heads, kv_heads, dim, (q_norm, k_norm, gemma),
                                cos, sin) is None


def test_bad_input_names_the_field():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="w_out"):
        torch.ops.kvfleet_cpu.gemma_rms_norm(torch.empty_like(x), x, None, torch.ones(8),
                                             torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="gelu_tanh_and_mul: x must be"):
        torch.ops.kvfleet_cpu.gelu_tanh_and_mul(torch.empty(2, 3), torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="q_weight and k_weight"):
        torch.ops.kvfleet_cpu.qk_norm_rotary(torch.randn(2, 5 * 8), 3, 1, 8, torch.ones(4),
                                             torch.ones(8), 1e-6, False, torch.ones(2, 4),
                                             torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        half = x.half()
        torch.ops.kvfleet_cpu.gelu_tanh_and_mul(torch.empty(2, 4).half(), half)
