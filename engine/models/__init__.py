"""Model implementations and loading: the Llama layout (Llama, Mistral, Qwen2, SmolLM2, Qwen3,
Phi-3, Mixtral, Qwen3-MoE) and Gemma 2/3; docs/models.md lists what each supports.

`load_model(dir, dtype)` turns a Hugging Face directory into a ready model (the class
`engine.models.registry` names for its architecture, a `LlamaForCausalLM` or subclass) plus
its `ModelConfig`; nothing here reads the environment or touches the network.
"""

from engine.models.config import Llama3RopeScaling, ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model, resolve_dtype

__all__ = ["Llama3RopeScaling", "LlamaForCausalLM", "ModelConfig", "load_model", "resolve_dtype"]
