"""The segmented LoRA kernels (kernels/triton/lora.py) vs the PyTorch reference
(engine.lora.ops.add_lora_delta_torch) on the same LoRABatch.

Batches mix adapters and base-model rows in interleaved and contiguous layouts, segments
longer than one row block, and shapes that are not multiples of the blocks (masked tails).
Base rows must come back bit-identical (never written); adapter rows within float rounding
(float32 1e-4: the kernel sums in another order; bfloat16 atol 2^-4, one ulp at the outputs'
magnitude (up to ~8), rtol two ulps: the reference rounds the expand's product before the
add, the kernel once after it, and the interpreter's float32->bfloat16 cast truncates).
"""

from __future__ import annotations

import pytest
import torch

from engine.lora.batch import build_lora_batch
from engine.lora.ops import add_lora_delta_torch
from kernels.triton import runtime
from kernels.triton.lora import sgmv_lora

# (row count, slot or -1 for the base model) per request, in flat-batch order.
LAYOUTS = {
    "interleaved": [(3, 0), (1, -1), (5, 2), (1, 0), (20, 1), (2, -1), (1, 2)],
    "contiguous": [(7, 1), (9, 1), (4, -1)],
    "decode": [(1, s) for s in (0, 1, -1, 2, 0, 1, -1, 2)],
}
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2.0**-4, 2.0**-6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(("in_features", "out_features", "width"), [(64, 96, 24), (72, 40, 8)])
def test_sgmv_matches_reference(dtype, layout, in_features, out_features, width, device):
    gen = torch.Generator().manual_seed(in_features + len(layout))
    counts = LAYOUTS[layout]
    num_tokens = sum(n for n, _ in counts)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    a = (0.3 * torch.randn(3, width, in_features, generator=gen)).to(dtype)
    b = (0.3 * torch.randn(3, out_features, width, generator=gen)).to(dtype)
    base = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    batch = build_lora_batch(counts)
    assert batch is not None
    expected = base.clone()
    add_lora_delta_torch(expected, x, a, b, batch)

    got = base.to(device)
    device_batch = build_lora_batch(counts, device)
    assert device_batch is not None
    before = runtime.launch_counts["lora_expand"]
    sgmv_lora(
        got,
        x.to(device),
        a.to(device),
        b.to(device),
        device_batch.rows,
        device_batch.seg_starts,
        device_batch.seg_slots,
        device_batch.max_segment_len,
    )
    assert runtime.launch_counts["lora_expand"] == before + 1
    got = got.cpu()

    base_rows = [i for i, slot in _row_slots(counts) if slot < 0]
    assert torch.equal(got[base_rows], base[base_rows]), "a base-model row was written"
    lora_rows = [i for i, slot in _row_slots(counts) if slot >= 0]
    assert not torch.equal(expected[lora_rows], base[lora_rows])  # the delta is not trivial
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


def test_no_adapter_rows_means_no_batch():
    assert build_lora_batch([(4, -1), (1, -1)]) is None


def _row_slots(counts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    slots = [slot for n, slot in counts for _ in range(n)]
    return list(enumerate(slots))
