"""Attention over the paged KV cache.

`AttentionMetadata` is built once per engine step by the model runner and shared by every
layer; `PagedAttention` is the per-layer module the model calls. The backend is chosen at
start-up (`engine.worker.device.resolve_attention_backend`): on CPU the compiled C++ kernels in
`kernels/cpu` when they build, else plain PyTorch; on CUDA — or on CPU, interpreted, when
`attention_backend="triton"` is asked for — the Triton kernels in `kernels/triton/`
(`kv_write.py` and `unified_attention.py`, driven by `engine/attention/triton_backend.py`).
"""

from engine.attention.metadata import (
    AttentionMetadata,
    DecodeBatch,
    PrefillBatch,
    PrefillSegment,
)
from engine.attention.paged_attention import PagedAttention

__all__ = ["AttentionMetadata", "DecodeBatch", "PrefillBatch", "PrefillSegment", "PagedAttention"]
