"""`LoRALinear`: a projection plus the step's batched LoRA delta.

`attach_lora` swaps the four projections of every decoder layer for wrappers around the very
same `Linear` (weights, packed copies and GEMM backend unchanged). It runs only when LoRA is
enabled, so a model without LoRA keeps plain `Linear` modules and pays nothing. A wrapper adds
the delta only while the shared `LoRAContext` holds a batch, i.e. in steps with adapter rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.lora.batch import LoRABatch
from engine.lora.ops import add_lora_delta
from engine.lora.slots import LoRASlots
from engine.models.linear import Linear


@dataclass
class LoRAContext:
    """The current step's rows-to-slots map, shared by every wrapper of one model."""

    use_triton: bool = False
    cpu_packed: bool = False  # the slots hold engine.lora.cpu_layout stacks
    batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: Linear,
        a: torch.Tensor,
        b: torch.Tensor,
        context: LoRAContext,
        rank: int,
        slice_offsets: torch.Tensor,
    ) -> None:
        super().__init__()
        self.base = base
        # Plain attributes, not buffers: the slots own them and they stay out of state_dict.
        self.lora_a = a
        self.lora_b = b
        self.context = context
        self.rank = rank
        self.slice_offsets = slice_offsets

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.context.batch
        if batch is not None:
            add_lora_delta(
                out,
                x,
                self.lora_a,
                self.lora_b,
                batch,
                self.context.use_triton,
                self.slice_offsets,
                self.rank,
                self.context.cpu_packed,
            )
        return out


def attach_lora(model: nn.Module, slots: LoRASlots, context: LoRAContext) -> None:
    """Wrap qkv_proj, o_proj, gate_up_proj and down_proj of every layer of `model`."""
    layers = model.layers
    assert isinstance(layers, nn.ModuleList)
    for index, layer in enumerate(layers):
        owners = {
            "qkv_proj": layer.self_attn,
            "o_proj": layer.self_attn,
            "gate_up_proj": layer.mlp,
            "down_proj": layer.mlp,
        }
        for name, owner in owners.items():
            base = getattr(owner, name)
            if isinstance(base, LoRALinear):
                raise RuntimeError("LoRA is already attached to this model")
            wrapped = LoRALinear(
                base,
                slots.a[name][index],
                slots.b[name][index],
                context,
                slots.rank,
                slots.slice_offsets[name],
            )
            setattr(owner, name, wrapped)
