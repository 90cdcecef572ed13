"""The Triton attention backend: KV write + one unified attention launch per layer.

Chosen at start-up (`engine.worker.device.resolve_attention_backend`): always on CUDA, and on CPU
when `attention_backend="triton"` is asked for explicitly, where the kernels run under
Triton's interpreter (how the engine is tested end to end through them without a GPU).
`load_kernels` must run before the first forward pass; it fixes the interpreter choice for
the process (see kernels.triton.runtime).

Invariants: the layer's cache is [2, num_blocks, block_size, num_kv_heads, head_dim] as for
the CPU paths; this step's K/V is written through `slot_mapping` before attention reads the
whole context through the block tables, so a chunk attends to itself and its prefix alike.
"""

from __future__ import annotations

import torch

from engine.attention.unified_batch import UnifiedBatch


def load_kernels(device: torch.device) -> None:
    """Import the kernels compiled (CUDA) or interpreted (CPU); raises RuntimeError if the
    process already holds them in the other mode."""
    from kernels.triton import runtime

    runtime.load(interpret=device.type != "cuda")


def triton_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim] (may be a strided view)
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    batch: UnifiedBatch,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, num_heads * head_dim]
    # Imported here, not at module level: the kernel modules must be imported by
    # `load_kernels` first, in the mode it chose.
    from kernels.triton.kv_write import kv_write
    from kernels.triton.unified_attention import unified_attention

    kv_write(key, value, kv_cache[0], kv_cache[1], slot_mapping)
    out = query.new_empty(query.shape)
    unified_attention(
        out, query, kv_cache[0], kv_cache[1], batch.block_tables, batch.query_start_loc,
        batch.seq_lens, scale, window, softcap,
    )
    return out.view(query.shape[0], -1)
