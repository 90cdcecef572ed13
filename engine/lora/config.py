"""`LoRAConfig`: the engine's LoRA settings, vLLM's names and defaults.

- `max_loras` (default 1): adapters resident in the compute slots at once, hence the most
  distinct adapters one step may hold.
- `max_lora_rank` (default 16): the largest adapter rank accepted; slots are sized for it.
- `max_cpu_loras` (default: `max_loras`): loaded adapters kept in host memory (LRU); an
  evicted one is read from its directory again when next needed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        validate_lora_args(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def validate_lora_args(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> None:
    if max_loras < 1:
        raise ValueError(f"max_loras must be at least 1, got {max_loras}")
    if max_lora_rank < 1:
        raise ValueError(f"max_lora_rank must be at least 1, got {max_lora_rank}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ValueError(
            f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})"
        )
