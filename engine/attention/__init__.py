"""Attention over the paged KV cache.

`AttentionMetadata` is built once per engine step by the model runner and shared by every
layer; `PagedAttention` is the per-layer module the model calls. On CPU the backend is plain
PyTorch, or the compiled C++ kernels in `kernels/cpu` when they build.
"""

from engine.attention.metadata import (
    AttentionMetadata,
    DecodeBatch,
    PrefillBatch,
    PrefillSegment,
)
from engine.attention.paged_attention import PagedAttention

__all__ = ["AttentionMetadata", "DecodeBatch", "PrefillBatch", "PrefillSegment", "PagedAttention"]
