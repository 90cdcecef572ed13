"""`LoRARequest`: which adapter a request runs with (vLLM's offline API name and fields).

`lora_name` identifies the adapter on this engine (it is the OpenAI `model` name in the
service); `lora_int_id` is vLLM's positive integer id, kept for API compatibility and checked
> 0; `lora_path` is the PEFT directory (adapter_config.json + adapter_model.safetensors).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r} has an empty lora_path")
