"""The compute slots: per layer and projection, stacked A and B buffers for `max_loras`
adapters, and which adapter (by block-hash key) sits in which slot.

Layout per projection with S slices (qkv: 3, gate_up: 2, o/down: 1) and R = max_lora_rank:
`a[layer]` is [max_loras, S * R, in] with slice i's A in rows i*R .. i*R + r, and `b[layer]`
is [max_loras, out, S * R] with slice i's scaled B in its own output rows and columns
i*R .. i*R + r; everything else is zero. So one shrink covers every slice of a fused
projection and one expand writes each slice's rows only from its own rank block (the zero
blocks add exact zeros), and ranks below R need no special case.

Invariant: `activate` never evicts an adapter the same step needs; the step's adapters must
number at most `max_loras` (the scheduler's admission rule guarantees it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

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
    ) -> None:
        self.max_loras = max_loras
        self.rank = max_lora_rank
        self.shapes = projection_shapes(config)
        self.a: dict[str, list[torch.Tensor]] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        for name in PROJECTIONS:
            shape = self.shapes[name]
            width = len(shape.slice_sizes) * max_lora_rank
            layers = range(config.num_hidden_layers)
            self.a[name] = [
                torch.zeros(max_loras, width, shape.in_features, dtype=dtype, device=device)
                for _ in layers
            ]
            self.b[name] = [
                torch.zeros(max_loras, shape.out_features, width, dtype=dtype, device=device)
                for _ in layers
            ]
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

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        rank = self.rank
        for name in PROJECTIONS:
            for layer_a, layer_b in zip(self.a[name], self.b[name], strict=True):
                layer_a[slot].zero_()
                layer_b[slot].zero_()
        for (layer, name), slices in adapter.weights.items():
            shape = self.shapes[name]
            a, b = self.a[name][layer][slot], self.b[name][layer][slot]
            for index, pair in enumerate(slices):
                if pair is None:
                    continue
                lora_a, lora_b = pair
                r = lora_a.shape[0]
                col = index * rank
                row = shape.slice_offset(index)
                a[col : col + r].copy_(lora_a)
                b[row : row + shape.slice_sizes[index], col : col + r].copy_(lora_b)
