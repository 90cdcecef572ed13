"""The C++ LoRA delta (kernels/cpu/lora_delta.cpp) vs the PyTorch reference
(engine.lora.ops.add_lora_delta_torch) on the same LoRABatch, float32.

B is built as engine/lora/slots.py stacks it: slice s of a fused projection owns its output
columns and rank block s; the rest is zero. The kernel gets both stacks packed by
engine.lora.cpu_layout (as the slots keep them when it serves), the reference the stacked
ones. Shapes cover interleaved and contiguous segments, decode rows, segments longer than one
8-row work unit, slice boundaries inside a 16-column tile (the mixed-tile path), output widths
that are not multiples of 16, ranks below, at and above one 16-lane tile, rank widths past 48
(more than one register block), and K with a tail.
Base rows must come back bit-identical; adapter rows within 1e-4 absolute: outputs reach ~50,
where a float32 ulp is ~4e-6, and up to 600 products are summed in another order.
"""

from __future__ import annotations

import pytest
import torch

from engine.lora.batch import build_lora_batch
from engine.lora.cpu_layout import pack_a, pack_b
from engine.lora.ops import add_lora_delta_torch, cpu_kernel_available

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ CPU kernels")

LAYOUTS = {
    "interleaved": [(3, 0), (1, -1), (5, 2), (1, 0), (20, 1), (2, -1), (1, 2)],
    "contiguous": [(7, 1), (9, 1), (4, -1)],
    "decode": [(1, s) for s in (0, 1, -1, 2, 0, 1, -1, 2)],
    "long": [(13, 2), (2, -1), (11, 0)],
}


def stacks(gen: torch.Generator, slices: tuple[int, ...], rank: int, k: int, loras: int = 3):
    width = len(slices) * rank
    a = torch.randn(loras, width, k, generator=gen) * 0.3
    b = torch.zeros(loras, sum(slices), width)
    row = 0
    for s, size in enumerate(slices):
        b[:, row : row + size, s * rank : (s + 1) * rank] = torch.randn(
            loras, size, rank, generator=gen
        )
        row += size
    return a, b


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    ("slices", "rank", "k"),
    [((64, 32, 32), 16, 64), ((40,), 8, 72), ((48, 48), 32, 576), ((17, 30), 20, 33),
     ((24, 24, 24), 32, 40)],
)
def test_cpu_lora_kernel_matches_reference(layout, slices, rank, k):
    gen = torch.Generator().manual_seed(len(layout) * 100 + rank + k)
    counts = LAYOUTS[layout]
    num_tokens = sum(n for n, _ in counts)
    a, b = stacks(gen, slices, rank, k)
    x = torch.randn(num_tokens, k, generator=gen)
    base = torch.randn(num_tokens, sum(slices), generator=gen)
    batch = build_lora_batch(counts)
    assert batch is not None
    expected = base.clone()
    add_lora_delta_torch(expected, x, a, b, batch)
    got = base.clone()
    offsets = torch.tensor([0, *torch.tensor(slices).cumsum(0).tolist()], dtype=torch.int64)
    torch.ops.kvfleet_cpu.lora_delta(
        got, x, pack_a(a), pack_b(b, offsets, rank), batch.rows, batch.seg_starts,
        batch.seg_slots, offsets, rank
    )
    slots = [slot for n, slot in counts for _ in range(n)]
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    lora_rows = [i for i, s in enumerate(slots) if s >= 0]
    assert torch.equal(got[base_rows], base[base_rows]), "a base-model row was written"
    assert not torch.equal(expected[lora_rows], base[lora_rows])  # the delta is not trivial
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_cpu_lora_kernel_refuses_mismatched_shapes():
    a, b = stacks(torch.Generator().manual_seed(0), (32,), 16, 64)
    batch = build_lora_batch([(2, 0)])
    assert batch is not None
    offsets = torch.tensor([0, 32], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.kvfleet_cpu.lora_delta(
            torch.zeros(2, 32),
            torch.zeros(2, 48),
            pack_a(a),
            pack_b(b, offsets, 16),
            batch.rows,
            batch.seg_starts,
            batch.seg_slots,
            offsets,
            16,
        )


def test_packed_slots_hold_the_packed_stacks(tiny_model_dir, tiny_lora_dirs):
    """The slots the kernel reads (cpu_packed) hold exactly the packed stacked slots, adapter
    for adapter, slot for slot, including after an eviction rewrote a slot."""
    from engine.lora.peft_adapter import load_peft_adapter
    from engine.lora.slots import LoRASlots
    from engine.models.config import ModelConfig

    config = ModelConfig.from_dir(tiny_model_dir)
    adapters = {
        name: load_peft_adapter(name, path, config, 8, torch.float32)
        for name, path in tiny_lora_dirs.items()
    }
    stacked = LoRASlots(config, 2, 8, torch.float32, torch.device("cpu"))
    packed = LoRASlots(config, 2, 8, torch.float32, torch.device("cpu"), cpu_packed=True)
    names = sorted(adapters)
    for keys in ([names[0], names[1]], [names[2]]):  # the second evicts one
        assert stacked.activate(keys, adapters.__getitem__) == packed.activate(
            keys, adapters.__getitem__
        )
        for name, shape in stacked.shapes.items():
            offsets = torch.tensor(
                [0, *torch.tensor(shape.slice_sizes).cumsum(0).tolist()], dtype=torch.int64
            )
            for layer, (a, b) in enumerate(zip(stacked.a[name], stacked.b[name], strict=True)):
                assert torch.equal(packed.a[name][layer], pack_a(a))
                assert torch.equal(packed.b[name][layer], pack_b(b, offsets, 8))
    assert any(packed.b[n][0].abs().sum() > 0 for n in packed.b)  # adapters were written
