"""The compute slots: per layer and projection, stacked A and B buffers for `max_loras`
adapters, and which adapter (by block-hash key) sits in which slot.

Layout per projection with S slices (qkv: 3, gate_up: 2, o/down: 1) and R = max_lora_rank:
`a[layer]` is [max_loras, S * R, in] with slice i's A in rows i*R .. i*R + r, and `b[layer]`
is [max_loras, out, S * R] with slice i's scaled B in its own output rows and columns
i*R .. i*R + r; everything else is zero. So one shrink covers every slice of a fused
projection and one expand writes each slice's rows only from its own rank block (the zero
blocks add exact zeros), and ranks below R need no special case. With `cpu_packed` the same
stacks are kept in the C++ CPU kernel's layout instead (engine.lora.cpu_layout): one layout
per engine, never both, so the adapters' memory is not doubled.

Invariant: `activate` never evicts an adapter the same step needs; the step's adapters must
number at most `max_loras` (the scheduler's admission rule guarantees it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from engine.lora.cpu_layout import pack_a, pack_b, packed_shapes
from engine.lora.peft_adapter import PROJECTIONS, LoRAAdapter, projection_shapes
from engine.models.config import ModelConfig


class LoRASlots:
    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        cpu_packed: bool = False,
    ) -> None:
        self.max_loras = max_loras
        self.rank = max_lora_rank
        self.cpu_packed = cpu_packed
        self.dtype, self.device = dtype, device
        self.shapes = projection_shapes(config)
        # Per projection, int64 [S + 1]: each fused slice's first output column, then `out`.
        self.slice_offsets = {
            name: torch.tensor([0, *itertools.accumulate(shape.slice_sizes)], dtype=torch.int64)
            for name, shape in self.shapes.items()
        }
        self.a: dict[str, list[torch.Tensor]] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        for name in PROJECTIONS:
            a_shape, b_shape = self._stack_shapes(name, max_loras)
            layers = range(config.num_hidden_layers)
            self.a[name] = [torch.zeros(a_shape, dtype=dtype, device=device) for _ in layers]
            self.b[name] = [torch.zeros(b_shape, dtype=dtype, device=device) for _ in layers]
        self.resident: list[str | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0

    def activate(self, keys: Sequence[str], load: Callable[[str], LoRAAdapter]) -> dict[str, int]:
        """Make every adapter in `keys` resident; returns key -> slot. Evicts the least
        recently used adapters the step does not need."""
        if len(set(keys)) > self.max_loras:
            raise RuntimeError(f"a step holds {len(set(keys))} adapters > max_loras")
        self._clock += 1
        slots: dict[str, int] = {}
        for key in keys:
            if key in self.resident:
                slots[key] = self.resident.index(key)
        for key in keys:
            if key in slots:
                continue
            slot = self._victim(set(slots.values()))
            self._write(slot, load(key))
            self.resident[slot] = key
            slots[key] = slot
        for slot in slots.values():
            self._last_used[slot] = self._clock
        return slots

    def _victim(self, taken: set[int]) -> int:
        free = [s for s in range(self.max_loras) if s not in taken]
        empty = [s for s in free if self.resident[s] is None]
        if empty:
            return empty[0]
        return min(free, key=lambda s: self._last_used[s])

    def _stack_shapes(self, name: str, loras: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = self.shapes[name]
        slices = len(shape.slice_sizes)
        if self.cpu_packed:
            return packed_shapes(
                shape.in_features, shape.out_features, slices, self.rank, loras
            )
        width = slices * self.rank
        return (loras, width, shape.in_features), (loras, shape.out_features, width)

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for name in PROJECTIONS:
            for layer_a, layer_b in zip(self.a[name], self.b[name], strict=True):
                layer_a[slot].zero_()
                layer_b[slot].zero_()
        for (layer, name), slices in adapter.weights.items():
            a, b = self._stacked(name, slices)
            if self.cpu_packed:
                offsets = self.slice_offsets[name]
                a, b = pack_a(a[None])[0], pack_b(b[None], offsets, self.rank)[0]
            self.a[name][layer][slot].copy_(a)
            self.b[name][layer][slot].copy_(b)

    def _stacked(
        self, name: str, slices: Sequence[tuple[torch.Tensor, torch.Tensor] | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's slices in the stacked layout: `a` [S*R, in] and `b` [out, S*R]."""
        rank, shape = self.rank, self.shapes[name]
        width = len(shape.slice_sizes) * rank
        a = torch.zeros(width, shape.in_features, dtype=self.dtype, device=self.device)
        b = torch.zeros(shape.out_features, width, dtype=self.dtype, device=self.device)
        for index, pair in enumerate(slices):
            if pair is None:
                continue
            lora_a, lora_b = pair
            r = lora_a.shape[0]
            col = index * rank
            row = shape.slice_offset(index)
            a[col : col + r].copy_(lora_a)
            b[row : row + shape.slice_sizes[index], col : col + r].copy_(lora_b)
        return a, b
