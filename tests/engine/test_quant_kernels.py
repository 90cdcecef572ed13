"""The quantized GEMMs (kernels/cpu/quant: the register kernel and the panel kernel) against a
dequantize-then-matmul reference, per GGUF format and path, on tiny random weights quantized
by gguf-py's reference quantizer, in float32 and bfloat16; the dequantization against
gguf-py's own; the plan's dispatch by row count; the Q/K row un-permutation against
transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.quant import formats, select
from engine.quant.gguf_model import _unpermute
from engine.quant.qlinear import (
    DENSE,
    KERNEL,
    PANEL,
    PANEL_Q4,
    PANEL_Q4P,
    QuantEmbedding,
    QuantLinear,
    QuantTensor,
)
from engine.quant.select import fit_plan
from kernels.cpu.quant import load

FORMATS = [formats.Q8_0, formats.Q4_0, formats.Q4_1]
K = 256


def _weight(qtype: int, n: int, seed: int = 0, k: int = K) -> QuantTensor:
    gen = torch.Generator().manual_seed(seed)
    return QuantTensor(formats.quantize(torch.randn(n, k, generator=gen), qtype), qtype, k)


@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
def test_dequantize_equals_gguf_py(qtype):
    t = _weight(qtype, 40)
    ref = torch.from_numpy(gguf_dequantize(t.raw.numpy(), GGMLQuantizationType(qtype)))
    assert torch.equal(formats.dequantize(t.raw, qtype, K), ref)
    assert torch.equal(t.dequantize(), ref)  # the C++ op where it loads


needs_kernel = pytest.mark.skipif(not load(), reason="quantized GEMM kernel not built")


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
@pytest.mark.parametrize("path", [KERNEL, PANEL, DENSE])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 32, 64])
def test_paths_match_dequantized_matmul_float32(qtype, path, rows):
    # A fused projection of odd-sized segments (37 + 30 rows: a panel of 32 plus a remainder,
    # tiles of 4 plus a remainder) and an odd number of blocks along K (9).
    k = 288
    parts = [_weight(qtype, 37, seed=1, k=k), _weight(qtype, 30, seed=2, k=k)]
    layer = QuantLinear(parts)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    dense = torch.cat([p.dequantize() for p in parts])
    ref = x.double() @ dense.double().T
    got = layer.run(x, path)
    assert got.shape == (rows, 67) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
@pytest.mark.parametrize("path", [KERNEL, PANEL, DENSE])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_paths_match_dequantized_matmul_bfloat16(qtype, path, rows):
    # A bfloat16 model: PANEL and DENSE multiply the weights rounded to bfloat16 (as the
    # bfloat16 dense copy holds them); the reference is that product in float64, and each
    # output may differ from it by the rounding of the bfloat16 result (plus summation order).
    k = 96
    parts = [_weight(qtype, 5, seed=3, k=k), _weight(qtype, 36, seed=4, k=k)]
    layer = QuantLinear(parts)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    weight = torch.cat([p.dequantize() for p in parts])
    if path != KERNEL:
        weight = weight.bfloat16()
    ref = x.double() @ weight.double().T
    got = layer.run(x, path)
    assert got.shape == (rows, 41) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
def test_bfloat16_panel_holds_the_weights_rounded_to_bfloat16(qtype):
    # x = identity: each output is one weight times 1, so the result is the panel itself,
    # which must be the float32 dequantization rounded to nearest even, bit for bit.
    k = 64
    w = _weight(qtype, 9, seed=5, k=k)
    layer = QuantLinear([w])
    got = layer.run(torch.eye(k, dtype=torch.bfloat16), PANEL)
    assert torch.equal(got.T, w.dequantize().bfloat16())
    assert torch.equal(w.dequantize(torch.bfloat16), w.dequantize().bfloat16())


@needs_kernel
def test_panel_kernel_refuses_bad_input_naming_it():
    w = _weight(formats.Q4_0, 8)
    x = torch.randn(2, K)
    with pytest.raises(RuntimeError, match="out shape"):
        torch.ops.kvfleet_quant.quant_linear_panel(torch.empty(2, 9), x, w.raw, w.qtype)
    with pytest.raises(RuntimeError, match="row bytes do not match K"):
        torch.ops.kvfleet_quant.quant_linear_panel(torch.empty(2, 8), x[:, :224].contiguous(),
                                                   w.raw, w.qtype)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        torch.ops.kvfleet_quant.quant_linear_panel(torch.empty(2, 8), x, w.raw, 12)


@needs_kernel
def test_plan_picks_the_path_by_rows():
    layer = QuantLinear([_weight(formats.Q8_0, 8)])
    layer.plan = ((2, KERNEL), (16, PANEL))
    assert [layer.path_for(r) for r in (1, 2, 3, 16, 17)] == [KERNEL, KERNEL, PANEL, PANEL, DENSE]
    layer.plan = ()
    assert layer.path_for(1) == DENSE


@needs_kernel
def test_plan_measures_every_path_per_layer_of_a_sweep():
    # Seconds per layer (a sweep of several layers is divided by their count); the register
    # kernel is never timed above KERNEL_MAX_ROWS rows.
    layers = [[QuantLinear([_weight(formats.Q4_1, 32, seed=i)])] for i in range(3)]
    few = select._measure(layers, 2, torch.float32)
    assert set(few) == {KERNEL, PANEL, DENSE}
    assert all(0 < t < float("inf") for t in few.values())
    many = select._measure(layers[:1], select.KERNEL_MAX_ROWS + 1, torch.float32)
    assert many[KERNEL] == float("inf") and many[PANEL] < float("inf")


def test_fit_plan_finds_the_crossovers_despite_one_noisy_timing():
    def t(kernel: float, panel: float, dense: float) -> dict[str, float]:
        return {KERNEL: kernel, PANEL: panel, DENSE: dense}

    times = {1: t(1, 2, 3), 4: t(2, 3, 9), 8: t(4, 3, 9),
             16: t(9, 5, 30),  # panel wins: one noisy dense-free slow kernel timing below
             32: t(20, 8, 7.9),  # a near tie the neighbours decide
             64: t(40, 30, 12), 128: t(float("inf"), 60, 20)}
    assert fit_plan(times) == ((4, KERNEL), (16, PANEL))
    times[8] = t(4, 300, 9)  # one descheduled panel run does not split the plan
    assert fit_plan(times) == ((8, KERNEL), (16, PANEL))
    assert fit_plan({1: t(5, 5, 1), 8: t(9, 9, 2)}) == ()


def test_fit_plan_gives_the_factored_panel_the_rows_below_the_rounded_one():
    def t(kernel: float, panel: float, dense: float, q4: float) -> dict[str, float]:
        return {KERNEL: kernel, PANEL: panel, DENSE: dense, PANEL_Q4: q4}

    times = {1: t(1, 3, 4, 3), 8: t(9, 5, 9, 4), 32: t(30, 9, 10, 6), 128: t(99, 40, 60, 50),
             256: t(99, 80, 60, 90)}
    assert fit_plan(times) == ((1, KERNEL), (32, PANEL_Q4), (128, PANEL))
    times[8] = t(9, 5, 9, 6)  # one slower PANEL_Q4 timing does not split its range
    assert fit_plan(times) == ((1, KERNEL), (32, PANEL_Q4), (128, PANEL))
    times[32] = t(30, 7, 10, 8)  # PANEL wins from 8 rows: no PANEL_Q4 range
    times[8] = t(9, 4, 9, 5)
    assert fit_plan(times) == ((1, KERNEL), (128, PANEL))


def test_fit_plan_ranks_the_packed_panel_before_the_factored_one():
    def t(kernel: float, panel: float, q4: float, q4p: float) -> dict[str, float]:
        return {KERNEL: kernel, PANEL: panel, DENSE: 99.0, PANEL_Q4: q4, PANEL_Q4P: q4p}

    times = {1: t(1, 3, 3, 2), 8: t(9, 5, 4, 3), 32: t(30, 9, 9, 6), 128: t(99, 40, 50, 45)}
    assert fit_plan(times) == ((1, KERNEL), (32, PANEL_Q4P), (128, PANEL))
    times[8] = t(9, 5, 3, 4)  # one faster PANEL_Q4 timing does not split PANEL_Q4P's range
    assert fit_plan(times) == ((1, KERNEL), (32, PANEL_Q4P), (128, PANEL))
    del times[8][PANEL_Q4P]  # a count without its timing: the path gets no range
    assert PANEL_Q4P not in {p for _, p in fit_plan(times)}


@needs_kernel
def test_plan_frees_the_packed_copies_unless_it_takes_them():
    layer = QuantLinear([_weight(formats.Q4_1, 32, seed=1)])
    if not layer.pack_panels():
        pytest.skip("panel-ordered Q4 kernel not built")
    model = torch.nn.Sequential(layer)
    select._keep_panels(model, ((1, KERNEL), (32, PANEL_Q4P)))
    assert layer.segments[0].packed is not None
    select._keep_panels(model, ((1, KERNEL), (32, PANEL_Q4)))
    assert layer.segments[0].packed is None


@needs_kernel
def test_a_layer_without_packed_copies_takes_the_plan_fitted_without_them():
    # A Q8_0 LM head beside packed Q4 projections: PANEL_Q4P in the plan must not send it to
    # the panel kernel at rows where the register kernel was measured faster.
    head = QuantLinear([_weight(formats.Q8_0, 32, seed=2)])
    head.plan = ((64, PANEL_Q4P),)
    head.plan_unpacked = ((4, KERNEL), (64, PANEL))
    assert [head.path_for(r) for r in (1, 4, 8)] == [KERNEL, KERNEL, PANEL]
    q4 = QuantLinear([_weight(formats.Q4_1, 32, seed=1)])
    q4.plan, q4.plan_unpacked = head.plan, head.plan_unpacked
    if q4.pack_panels():
        assert q4.path_for(1) == PANEL_Q4P


@needs_kernel
def test_plan_times_the_factored_panel_only_for_bfloat16_q4():
    q4 = [[QuantLinear([_weight(formats.Q4_1, 32, seed=1)])]]
    q8 = [[QuantLinear([_weight(formats.Q8_0, 32, seed=1)])]]
    assert PANEL_Q4 not in select._measure(q4, 8, torch.float32)
    assert PANEL_Q4 not in select._measure(q8, 8, torch.bfloat16)
    if torch.ops.kvfleet_quant.quant_has_q4_panel_factored():
        assert select._measure(q4, 8, torch.bfloat16)[PANEL_Q4] < float("inf")
        assert PANEL_Q4P not in select._measure(q4, 8, torch.bfloat16)  # no copies made
        q4[0][0].pack_panels()
        assert select._measure(q4, 8, torch.bfloat16)[PANEL_Q4P] < float("inf")


def test_unpermute_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, head_dim = 3, 8
    w = np.arange(heads * head_dim * 32, dtype=np.float32).reshape(heads * head_dim, 32)
    ref = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
    got = _unpermute(QuantTensor(torch.from_numpy(w).view(torch.uint8), formats.F32, 32), heads)
    assert torch.equal(got.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_rows_equal_gguf_py_dequantization(qtype, dtype):
    # The looked-up rows through the C++ op (where it loads) equal gguf-py's dequantization
    # of those rows, cast to the model's dtype once; ids keep their shape.
    table = _weight(qtype, 40, seed=6, k=64)
    ids = torch.tensor([[3, 0, 39], [3, 17, 5]])
    got = QuantEmbedding(table, dtype)(ids)
    ref = torch.from_numpy(gguf_dequantize(table.raw.numpy(), GGMLQuantizationType(qtype)))
    assert got.shape == (2, 3, 64) and got.dtype == dtype
    assert torch.equal(got, ref[ids].to(dtype))


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS, ids=formats.type_name)
@pytest.mark.parametrize("k", [288, 1536])
def test_float32_one_row_sums_do_not_depend_on_the_row_tiling(qtype, k):
    # One float32 row runs weight rows 4 at a time (short rows) or one at a time (rows of 512+
    # bytes, and every remainder): each output must be the same float either way, so the
    # float32 exactness against transformers does not hinge on the tiling.
    w = _weight(qtype, 11, seed=8, k=k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(9))
    whole = torch.empty(1, 11)
    torch.ops.kvfleet_quant.quant_linear(whole, x, w.raw, w.qtype)
    for n in range(11):
        one = torch.empty(1, 1)
        torch.ops.kvfleet_quant.quant_linear(one, x, w.raw[n:n + 1].contiguous(), w.qtype)
        assert torch.equal(one[0, 0], whole[0, n]), n
