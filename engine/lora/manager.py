"""`LoRAManager`: the engine's one LoRA object — registry, slots, the model's wrappers and
the per-step batch map.

The engine calls `resolve` when a request arrives (a `LoRARequest` is loaded on first use, as
vLLM's offline API does; a name must already be served), `begin_step` with the step's
scheduled requests before the forward pass and `end_step` after it. Steps without adapter
rows set no batch, so the wrappers add nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.core.scheduler_output import ScheduledRequest
from engine.lora.admission import LoRAAdmission
from engine.lora.batch import build_lora_batch
from engine.lora.config import LoRAConfig
from engine.lora.layers import LoRAContext, attach_lora
from engine.lora.ops import cpu_kernel_available
from engine.lora.registry import LoRARegistry
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots
from engine.models.config import ModelConfig


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        model: nn.Module,
        model_config: ModelConfig,
        dtype: torch.dtype,
        use_triton: bool = False,
        cpu_kernel: bool = True,
    ) -> None:
        self.config = config
        device = next(model.parameters()).device
        self.device = device
        self.registry = LoRARegistry(model_config, config.max_lora_rank, config.cpu_capacity, dtype)
        # The C++ kernel serves float32 on CPU; its layout is chosen once, with the slots.
        cpu_packed = (
            cpu_kernel
            and not use_triton
            and device.type == "cpu"
            and dtype == torch.float32
            and cpu_kernel_available()
        )
        self.slots = LoRASlots(
            model_config, config.max_loras, config.max_lora_rank, dtype, device, cpu_packed
        )
        self.context = LoRAContext(use_triton=use_triton, cpu_packed=cpu_packed)
        self.admission = LoRAAdmission(config.max_loras)
        attach_lora(model, self.slots, self.context)

    def resolve(self, lora: LoRARequest | str) -> str:
        """The key a request of this adapter carries (its `lora_id`); ValueError if bad."""
        if isinstance(lora, LoRARequest):
            return self.registry.add(lora)
        return self.registry.key_for(lora)

    def load(self, lora: LoRARequest) -> None:
        self.registry.add(lora)

    def unload(self, name: str) -> bool:
        return self.registry.remove(name)

    def list_adapters(self) -> list[LoRARequest]:
        return list(self.registry.served.values())

    def begin_step(self, scheduled: Sequence[ScheduledRequest]) -> None:
        keys = list(
            dict.fromkeys(s.request.lora_id for s in scheduled if s.request.lora_id is not None)
        )
        if not keys:
            self.context.batch = None
            return
        slots = self.slots.activate(keys, self.registry.weights)
        counts = [
            (s.num_new_tokens, -1 if s.request.lora_id is None else slots[s.request.lora_id])
            for s in scheduled
        ]
        self.context.batch = build_lora_batch(counts, self.device)

    def end_step(self) -> None:
        self.context.batch = None
