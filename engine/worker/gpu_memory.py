"""KV-cache sizing on CUDA, in the manner of vLLM's `gpu_memory_utilization`.

The engine may use `utilization x total` bytes of the GPU. Out of that come: memory already in
use when the engine started (other processes, this process's CUDA context), the weights, and
the peak activation memory of the largest step the scheduler can build (measured by running
one: `max_num_batched_tokens` prompt tokens, then logits for `max_num_seqs` rows). What is left
is the KV cache. `plan_kv_blocks` is the arithmetic, kept pure so it is unit-tested on CPU;
`profile_peak_activations` measures on the GPU.

Invariants: CPU engines never come here (their KV size is `kv_cache_memory_bytes`); nothing
touches CUDA at import time; a budget smaller than one KV block is an error whose message has
the numbers and says what to lower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.attention.unified_batch import UnifiedBatch
from engine.models.llama import LlamaForCausalLM

GIB = 2**30


class GpuMemoryError(ValueError):
    """The configured utilization leaves no room for a KV cache."""


@dataclass(frozen=True)
class GpuMemoryProfile:
    total_bytes: int
    # In use before the engine loaded anything: other processes and the CUDA context.
    other_bytes: int
    weights_bytes: int
    peak_activation_bytes: int


def plan_kv_blocks(profile: GpuMemoryProfile, utilization: float, bytes_per_block: int) -> int:
    """KV blocks that fit in `utilization` of the GPU after everything else."""
    allowed = int(utilization * profile.total_bytes)
    budget = (
        allowed - profile.other_bytes - profile.weights_bytes - profile.peak_activation_bytes
    )
    blocks = budget // bytes_per_block if budget > 0 else 0
    if blocks < 1:
        raise GpuMemoryError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization {utilization} of "
            f"{profile.total_bytes / GIB:.2f} GiB allows {allowed / GIB:.2f} GiB, but "
            f"{profile.other_bytes / GIB:.2f} GiB was already in use, the weights take "
            f"{profile.weights_bytes / GIB:.2f} GiB and peak activations "
            f"{profile.peak_activation_bytes / GIB:.2f} GiB (one KV block needs "
            f"{bytes_per_block} bytes); raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens or --max-num-seqs, or choose a smaller --dtype"
        )
    return blocks


# What to lower when a start-up stage runs out of GPU memory.
_ADVICE = {
    "weights": "free the GPU, choose a smaller --dtype (bfloat16), or use a larger GPU",
    "activations": "lower --max-num-batched-tokens or --max-num-seqs",
    "KV cache": "lower --num-kv-blocks / --kv-cache-memory-bytes or --gpu-memory-utilization",
}


def out_of_memory(stage: str, asked_bytes: int, device: torch.device) -> GpuMemoryError:
    """The start-up error for a CUDA out-of-memory while allocating `stage`."""
    in_use, total = memory_in_use(device)
    return GpuMemoryError(
        f"out of GPU memory allocating the {stage} ({asked_bytes / GIB:.2f} GiB asked; "
        f"{in_use / GIB:.2f} of {total / GIB:.2f} GiB in use on {device}, weights "
        f"{torch.cuda.memory_allocated(device) / GIB:.2f} GiB of it): {_ADVICE[stage]}"
    )


def memory_in_use(device: torch.device) -> tuple[int, int]:
    """(bytes in use on the device by anyone, total bytes). This process's cached-but-free
    allocator blocks (an engine freed earlier) are released first, so they do not count."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total


@torch.inference_mode()
def profile_peak_activations(
    model: LlamaForCausalLM,
    device: torch.device,
    dtype: torch.dtype,
    num_tokens: int,
    num_sample_rows: int,
    block_size: int,
) -> int:
    """Peak bytes allocated by one forward of `num_tokens` prompt tokens plus the logits of
    `num_sample_rows` rows, beyond what was allocated before (the weights)."""
    from engine.attention.triton_backend import load_kernels

    load_kernels(device)
    config = model.config
    num_blocks = -(-num_tokens // block_size)
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    unified = UnifiedBatch(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),
    )
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        prefills=(),
        decode=None,
        num_tokens=num_tokens,
        unified=unified,
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, device=device)
    hidden = model(ids, positions, caches, meta)
    rows = min(num_sample_rows, num_tokens)
    logits = model.compute_logits(hidden[-rows:])
    logits.max(dim=-1).indices.tolist()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, hidden, logits
    torch.cuda.empty_cache()
    return peak
