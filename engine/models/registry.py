"""Which model class serves each architecture, and which engine features it supports.

`model_class(architecture)` picks the implementation (config.json's `architectures[0]`);
`check_features(architecture, ...)` refuses, at engine start, a feature the family cannot run
correctly yet, naming both; an architecture missing here was already refused by
`ModelConfig` (engine.models.config.SUPPORTED_ARCHITECTURES) with the supported list.

Invariant: a feature is marked supported only where a test runs it with that family; the
table in docs/models.md is this one in prose.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.gemma import GemmaForCausalLM
from engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Family:
    model: type[LlamaForCausalLM]
    lora: bool = True
    spec_decode: bool = True
    # The Triton attention kernel (every CUDA run, CPU when asked).
    triton: bool = True
    # Decode steps as captured CUDA graphs. MoE on CUDA runs kernels/triton/fused_moe.py,
    # which sizes its grid from shapes alone (no host sync), but no graph of it has been
    # captured on a GPU yet: those decode eagerly (logged) until that is checked.
    cuda_graphs: bool = True


_LLAMA = Family(LlamaForCausalLM)
# Families added with issue 39: the exactness suite runs them on the CPU attention paths, with
# n-gram speculative decoding, and through the Triton kernel
# (tests/kernels_triton/test_engine_triton_gemma.py). LoRA: tested on Qwen3 and Gemma 2
# (tests/engine/test_family_lora.py); Phi-3's adapters target its fused qkv_proj/gate_up_proj,
# which the adapter loader does not split, and MoE experts have no LoRA slots.
_QWEN3 = Family(LlamaForCausalLM)
_NO_LORA = Family(LlamaForCausalLM, lora=False)
_MOE = Family(LlamaForCausalLM, lora=False, cuda_graphs=False)
_GEMMA = Family(GemmaForCausalLM)

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _QWEN3,
    "Phi3ForCausalLM": _NO_LORA,
    "MixtralForCausalLM": _MOE,
    "Qwen3MoeForCausalLM": _MOE,
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
}

_WHY = {
    "lora": "LoRA adapters",
    "spec_decode": "speculative decoding",
    "triton": "the Triton attention backend (every CUDA device, attention_backend='triton')",
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    family = FAMILIES.get(architecture)
    if family is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(FAMILIES)}")
    return family.model


def supports_cuda_graphs(architecture: str) -> bool:
    return FAMILIES[architecture].cuda_graphs


def check_features(architecture: str, lora: bool, spec_decode: bool, triton: bool) -> None:
    """Raise ValueError naming the first requested feature `architecture` cannot run."""
    family = FAMILIES[architecture]
    wanted = {"lora": lora, "spec_decode": spec_decode, "triton": triton}
    for feature, on in wanted.items():
        if on and not getattr(family, feature):
            raise ValueError(
                f"{architecture} does not support {_WHY[feature]} yet; start the engine "
                "without it (see docs/models.md)")
