"""Attention over the paged KV cache.

`AttentionMetadata` is built once per engine step by the model runner and shared by every
layer; `PagedAttention` is the per-layer module the model calls. On CPU the backend is plain
PyTorch (`torch_paged.py`); on CUDA the Triton kernel in `kernels/` is used.
"""

from engine.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSegment
from engine.attention.paged_attention import PagedAttention

__all__ = ["AttentionMetadata", "DecodeBatch", "PrefillSegment", "PagedAttention"]
