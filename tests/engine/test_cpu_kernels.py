"""The compiled CPU kernels equal their PyTorch counterparts: paged decode attention against
attention over the gathered context (head sizes 16..128, GQA groups 1..5, block sizes 1..32,
a strided query, bfloat16), the K/V cache write against index_copy_, and the fused elementwise
ops against `LayerOps`. The prefill kernel has its own file, test_cpu_prefill_kernel.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import load


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    assert load(), "the CPU kernel should build on this machine (g++ and ninja are installed)"


def reference(q, k_cache, v_cache, table, length, scale):
    block_size, kvh, d = k_cache.shape[1:]
    slots = (table.long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
    slots = slots[:length]
    k = k_cache.reshape(-1, kvh, d)[slots].transpose(0, 1)
    v = v_cache.reshape(-1, kvh, d)[slots].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(1).float(), k.float(), v.float(), scale=scale, enable_gqa=True
    )
    return out.squeeze(1)


def decode_case(lengths, heads, kv_heads, dim, dtype, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    # Scattered, non-contiguous block ids, as a long-running pool hands them out.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = -(-max(lengths) // block_size) + 1  # padded
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for row, length in enumerate(lengths):
        n = -(-length // block_size)
        tables[row, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    # q is a strided view, as the fused qkv projection produces.
    wide = torch.randn(len(lengths), heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    return wide[:, :heads], k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32)


def check_decode(lengths, heads, kv_heads, dim, dtype, tol, block_size=16):
    q, k_cache, v_cache, tables, lens = decode_case(
        lengths, heads, kv_heads, dim, dtype, block_size
    )
    out = torch.empty(q.shape, dtype=dtype)
    torch.ops.kvfleet_cpu.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, 0.125)
    for row, length in enumerate(lengths):
        expected = reference(q[row], k_cache, v_cache, tables[row], length, 0.125)
        torch.testing.assert_close(out[row].float(), expected, atol=tol, rtol=tol)


LENGTHS = [1, 15, 16, 17, 100, 200, 333]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (4, 4, 128), (8, 2, 128), (4, 1, 64), (4, 2, 16), (6, 3, 32), (10, 2, 64)],
)
def test_decode_kernel_matches_gathered_attention(dtype, tol, heads, kv_heads, dim):
    check_decode(LENGTHS, heads, kv_heads, dim, dtype, tol)
    # Many requests: one work item per request instead of per (request, KV head).
    check_decode(LENGTHS * 3, heads, kv_heads, dim, dtype, tol)


@pytest.mark.parametrize("block_size", [1, 5, 8, 32])
def test_decode_kernel_any_block_size(block_size):
    check_decode(LENGTHS, 9, 3, 64, torch.float32, 1e-5, block_size)


def test_fused_elementwise_ops_match_pytorch_path():
    from engine.models.layer_ops import LayerOps

    gen = torch.Generator().manual_seed(1)
    fused, plain = LayerOps(fused=True), LayerOps(fused=False)
    x = torch.randn(37, 96, generator=gen)
    weight = torch.randn(96, generator=gen)
    assert torch.allclose(fused.rms_norm(x, weight, 1e-5), plain.rms_norm(x, weight, 1e-5),
                          atol=1e-5)
    res_a, res_b = torch.randn(37, 96, generator=gen), None
    res_b = res_a.clone()
    out_a = fused.add_rms_norm(x, res_a, weight, 1e-5)
    out_b = plain.add_rms_norm(x, res_b, weight, 1e-5)
    assert torch.equal(res_a, res_b)
    assert torch.allclose(out_a, out_b, atol=1e-5)
    gate_up = torch.randn(37, 2 * 80, generator=gen)
    assert torch.allclose(fused.silu_and_mul(gate_up), plain.silu_and_mul(gate_up), atol=1e-6)
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(37, (heads + 2 * kv_heads) * dim, generator=gen)
    cos = torch.randn(37, 1, dim // 2, generator=gen)
    sin = torch.randn(37, 1, dim // 2, generator=gen)
    expected = plain.rotary_qkv(qkv.clone(), heads, kv_heads, dim, cos, sin)
    got = fused.rotary_qkv(qkv.clone(), heads, kv_heads, dim, cos, sin)
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a, b, atol=1e-6)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_ops_allocate_a_contiguous_output_for_any_input(dtype):
    """The ops allocate their output from the contiguous input: a transposed activation gives
    the bits of its contiguous copy (an output shaped like the strided input, as the Python
    side allocated before, was refused)."""
    from engine.models.layer_ops import LayerOps

    gen = torch.Generator().manual_seed(3)
    ops = LayerOps(fused=True)
    x = torch.randn(96, 9, generator=gen).to(dtype).t()
    weight = torch.randn(96, generator=gen).to(dtype)
    got = ops.rms_norm(x, weight, 1e-5)
    assert got.is_contiguous() and torch.equal(got, ops.rms_norm(x.contiguous(), weight, 1e-5))
    res_a = torch.randn(9, 96, generator=gen).to(dtype)
    res_b = res_a.clone()
    got = ops.add_rms_norm(x, res_a, weight, 1e-5)
    assert torch.equal(got, ops.add_rms_norm(x.contiguous(), res_b, weight, 1e-5))
    assert torch.equal(res_a, res_b)
    gate_up = torch.randn(9, 160, generator=gen).to(dtype)
    assert ops.silu_and_mul(gate_up).shape == (9, 80)

ROW_COUNTS = [1, 7, 64, 300]  # one token, a kRowGrain remainder, a full batch, a prefill


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bitwise equality of two bf16 tensors; NaNs match any NaN (payloads are not specified)."""
    nan = expected.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(
        got[~nan].view(torch.int16), expected[~nan].view(torch.int16)
    )


def wide_range_bf16(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Activations whose rows differ in scale by orders of magnitude and carry outliers, so a
    different summation order or rounding point shows up in the results."""
    scale = torch.exp(2 * torch.randn(rows, 1, generator=gen))
    x = torch.randn(rows, cols, generator=gen) * scale
    spikes = torch.rand(rows, cols, generator=gen) < 0.01
    return torch.where(spikes, x * 300, x).to(torch.bfloat16)


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("hidden", [576, 100, 2048, 4104])  # 100: tails; 2048+: cascaded sums
def test_bf16_rms_norms_equal_the_pytorch_path_bit_for_bit(rows: int, hidden: int) -> None:
    from engine.models.layer_ops import LayerOps

    gen = torch.Generator().manual_seed(rows * 10_000 + hidden)
    fused, plain = LayerOps(fused=True), LayerOps(fused=False)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    x = wide_range_bf16(rows, hidden, gen)
    assert same_bits(fused.rms_norm(x, weight, 1e-5), plain.rms_norm(x, weight, 1e-5))
    residual = wide_range_bf16(rows, hidden, gen)
    res_fused, res_plain = residual.clone(), residual.clone()
    out_fused = fused.add_rms_norm(x, res_fused, weight, 1e-6)
    out_plain = plain.add_rms_norm(x, res_plain, weight, 1e-6)
    assert same_bits(res_fused, res_plain)
    assert same_bits(out_fused, out_plain)


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("inter", [1536, 72])  # 72: a partial 16-lane chunk per row
def test_bf16_silu_and_mul_equals_the_pytorch_path_bit_for_bit(rows: int, inter: int) -> None:
    from engine.models.layer_ops import LayerOps

    gen = torch.Generator().manual_seed(rows * 10_000 + inter)
    gate_up = wide_range_bf16(rows, 2 * inter, gen)
    expected = LayerOps(fused=False).silu_and_mul(gate_up)
    assert same_bits(LayerOps(fused=True).silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("width", [256, 16])  # ATen's vectorised loop, and its scalar tail
def test_bf16_silu_is_exact_for_every_bf16_input(width: int) -> None:
    """The kernel reads SiLU from a table of F.silu's own results; every one of the 65,536 gate
    values (NaNs and infinities included) must come out as the PyTorch path computes it."""
    from engine.models.layer_ops import LayerOps

    gen = torch.Generator().manual_seed(2)
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gate = gate.view(torch.bfloat16).reshape(-1, width)
    for up in (torch.ones_like(gate), torch.randn(gate.shape, generator=gen).to(torch.bfloat16)):
        gate_up = torch.cat((gate, up), dim=-1)
        expected = LayerOps(fused=False).silu_and_mul(gate_up)
        assert same_bits(LayerOps(fused=True).silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (2, 1, 128)])
def test_bf16_rotary_equals_the_pytorch_path_bit_for_bit(
    rows: int, heads: int, kv_heads: int, dim: int
) -> None:
    """On the model's rope tables and on a qkv that is a column slice of a wider buffer (rows
    strided), rotating q and k in place and leaving v and the rest of the buffer untouched."""
    from engine.models.layer_ops import LayerOps
    from engine.models.rope import RotaryEmbedding

    gen = torch.Generator().manual_seed(rows * 1_000 + dim)
    width = (heads + 2 * kv_heads) * dim
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    cos, sin = RotaryEmbedding(dim, 4096, 10000.0).lookup(positions, torch.bfloat16)
    buffer = wide_range_bf16(rows, width + 24, gen)
    expected = LayerOps(fused=False).rotary_qkv(
        buffer[:, 8 : 8 + width].clone(), heads, kv_heads, dim, cos, sin
    )
    before = buffer.clone()
    got = LayerOps(fused=True).rotary_qkv(buffer[:, 8 : 8 + width], heads, kv_heads, dim, cos, sin)
    for a, b in zip(got, expected, strict=True):
        assert same_bits(a, b)
    # q, k, v are views into the buffer (no copies), unit stride in the head dimension as the
    # attention kernels read them.
    storage = buffer.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage and t.stride(-1) == 1 for t in got)
    assert torch.equal(buffer[:, :8], before[:, :8]) and torch.equal(
        buffer[:, 8 + width :], before[:, 8 + width :]
    )


def test_float16_stays_on_the_pytorch_path() -> None:
    from engine.models.layer_ops import LayerOps

    x = torch.randn(5, 64).half()
    weight = torch.ones(64).half()
    assert torch.equal(
        LayerOps(fused=True).rms_norm(x, weight, 1e-5),
        LayerOps(fused=False).rms_norm(x, weight, 1e-5),
    )


def test_a_builder_killed_mid_build_blocks_no_later_load(tmp_path, monkeypatch) -> None:
    """What an engine kill -9'd during its first build leaves (torch's build lock, a half-done
    build directory) must not make the next engine wait forever: it loads the library."""
    import kernels.cpu

    built = kernels.cpu._build_dir() / "kvfleet_cpu_ops.so"
    assert built.is_file()
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    cache = kernels.cpu._build_dir()
    shutil.copy(built, cache / built.name)
    (cache / "lock").touch()
    (cache / "build-12345-dead").mkdir()
    code = "import sys; from kernels.cpu import load; sys.exit(0 if load() else 1)"
    result = subprocess.run([sys.executable, "-c", code], env=os.environ.copy(), timeout=120,
                            cwd=Path(__file__).resolve().parents[2], capture_output=True)
    assert result.returncode == 0, result.stderr.decode()[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_index_copy(dtype):
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 9, 16, 3, 64, generator=gen).to(dtype)
    expected = cache.clone()
    # key/value are strided views of a fused qkv projection, slots scattered.
    qkv = torch.randn(40, 15, 64, generator=gen).to(dtype)
    key, value = qkv[:, 9:12], qkv[:, 12:15]
    slots = torch.randperm(9 * 16, generator=gen)[:40]
    expected[0].view(-1, 3, 64).index_copy_(0, slots, key)
    expected[1].view(-1, 3, 64).index_copy_(0, slots, value)
    torch.ops.kvfleet_cpu.write_kv_cache(cache, key, value, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.kvfleet_cpu.write_kv_cache(cache, key[:1], value[:1], torch.tensor([9 * 16]))


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_equals_rotary_then_write(dtype, rows):
    """The fused RoPE + K/V write gives the bits of rotary_qkv followed by write_kv_cache: the
    same q/k/v views of a strided qkv (column slice of a wider buffer) and the same cache."""
    from engine.models.layer_ops import LayerOps

    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim = 9, 3, 64
    width = (heads + 2 * kv_heads) * dim
    buffer = torch.randn(rows, width + 16, generator=gen).to(dtype)
    cos = torch.randn(rows, 1, dim // 2, generator=gen).to(dtype)
    sin = torch.randn(rows, 1, dim // 2, generator=gen).to(dtype)
    cache = torch.randn(2, 9, 16, kv_heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(9 * 16, generator=gen)[:rows]
    ops = LayerOps(fused=True)
    expected_buffer, expected_cache = buffer.clone(), cache.clone()
    q, k, v = ops.rotary_qkv(expected_buffer[:, 8 : 8 + width], heads, kv_heads, dim, cos, sin)
    torch.ops.kvfleet_cpu.write_kv_cache(expected_cache, k, v, slots)
    got = ops.rotary_qkv_write_kv(buffer[:, 8 : 8 + width], heads, kv_heads, dim, cos, sin,
                                  cache, slots)
    assert got is not None
    for a, b in zip(got, (q, k, v), strict=True):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    assert torch.equal(buffer, expected_buffer) and torch.equal(cache, expected_cache)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotary_qkv_write_kv(buffer[:1, 8 : 8 + width], heads, kv_heads, dim, cos[:1], sin[:1],
                                cache, torch.tensor([9 * 16]))
    # Where the cache's dtype differs the fused op does not apply: nothing is done.
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert ops.rotary_qkv_write_kv(buffer[:, 8 : 8 + width], heads, kv_heads, dim, cos, sin,
                                   cache.to(other), slots) is None
