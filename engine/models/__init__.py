"""Model implementations and loading (Llama family: Llama, Mistral, Qwen2, SmolLM2).

`load_model(dir, dtype)` turns a Hugging Face directory into a ready `LlamaForCausalLM` plus
its `ModelConfig`; nothing here reads the environment or touches the network.
"""

from engine.models.config import Llama3RopeScaling, ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model, resolve_dtype

__all__ = ["Llama3RopeScaling", "LlamaForCausalLM", "ModelConfig", "load_model", "resolve_dtype"]
