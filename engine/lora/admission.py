"""The scheduler's LoRA rule: a step holds at most `max_loras` distinct adapters.

Running requests are always scheduled, so the rule is kept at the door: a waiting (or swapped)
request may join the running set only if its adapter is already running or fewer than
`max_loras` adapters are. Once one adapter request is refused in an admission pass, every
later adapter request of that pass is refused too (base-model requests still pass, they take
no adapter slot): requests of running adapters cannot overtake the refused one and keep their
adapters resident forever, so it gets the first slot that frees — no starvation.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.request import Request


class LoRAAdmission:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    def begin(self) -> LoRAAdmissionPass:
        return LoRAAdmissionPass(self.max_loras)


class LoRAAdmissionPass:
    """One admission pass (one step): call `admits` for candidates in queue order."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.blocked = False

    def admits(self, request: Request, running: Iterable[Request]) -> bool:
        if request.lora_id is None:
            return True
        if self.blocked:
            return False
        active = {r.lora_id for r in running if r.lora_id is not None}
        if request.lora_id in active or len(active) < self.max_loras:
            return True
        self.blocked = True
        return False
