"""kvfleet's engine: paged KV cache, continuous batching, and the offline `LLM` API.

Layout: the public API at this level (`llm.LLM`, `outputs`, `config`, `logprobs`,
`completion_tracker`); the loop in `core/` (`llm_engine`, scheduler, KV cache manager, block
pool, urgent steps); the worker in `worker/` (inputs, model runner, sampler); `models/`,
`attention/`, `lora/`, `spec_decode/` and `kv_tiers/` beside them; `service/` runs the engine
as a gRPC service. `SamplingParams` and `StructuredOutputsParams` live in `kvfleet.contracts`
(the router shares them) and are re-exported here; `structured/` constrains decoding to them.

Public names are imported lazily, so `import engine` pulls in no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.outputs import CompletionOutput, RequestOutput
    from kvfleet.contracts.sampling_params import SamplingParams
    from kvfleet.contracts.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
    "CompletionOutput",
]

_LAZY = {
    "LLM": "engine.llm",
    "LoRARequest": "engine.lora.request",
    "SamplingParams": "kvfleet.contracts.sampling_params",
    "StructuredOutputsParams": "kvfleet.contracts.structured_outputs",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
