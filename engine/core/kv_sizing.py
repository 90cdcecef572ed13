"""Start-up sizing of the KV cache: device blocks, host (swap / tier) blocks, the manager.

Role: the engine's start-up arithmetic, out of the engine loop (engine.core.llm_engine calls
it once, in order: `size_kv_cache`, `size_host_kv`, `make_kv_manager`, then `log_kv_cache`).
Device blocks come from `num_kv_blocks` when given, else from the GPU's free memory after the
weights and a profiled largest step (CUDA, engine.worker.gpu_memory), else from
`kv_cache_memory_bytes` (CPU, or CUDA when set). Host blocks come from
engine.kv_tiers.offload.plan_host_layout.

With sliding-window KV groups (`plan_sliding_kv`) a block holds `group_size` layers, not
every layer, so the same budget gives more blocks.

Invariants: a budget smaller than one KV block is a ValueError with the numbers; nothing here
keeps state, so sizing twice with the same inputs gives the same layout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_groups import KVGroupLayout, plan_kv_groups
from engine.kv_tiers.host_tier import HostKVTier
from engine.kv_tiers.offload import plan_host_layout
from engine.kv_tiers.swap_space import SwapSpace
from engine.kv_tiers.transfer import HostLayout
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.worker.gpu_memory import (
    GpuMemoryProfile,
    out_of_memory,
    plan_kv_blocks,
    profile_peak_activations,
)
from engine.worker.model_runner import kv_cache_bytes_per_block

logger = logging.getLogger("kvfleet.engine")


@dataclass(frozen=True)
class KVCacheLayout:
    num_blocks: int
    bytes_per_block: int


def size_kv_cache(
    config: EngineConfig,
    model: LlamaForCausalLM,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    gpu_in_use_at_start: tuple[int, int] | None,
    groups: KVGroupLayout | None = None,
) -> KVCacheLayout:
    """`gpu_in_use_at_start`: (bytes in use, total) measured before the weights were loaded;
    None on CPU."""
    per_block = kv_cache_bytes_per_block(model_config, config.block_size, dtype, groups)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif device.type == "cuda" and config.kv_cache_memory_bytes is None:
        assert gpu_in_use_at_start is not None  # measured by the engine on CUDA
        num_blocks = _gpu_kv_blocks(
            config, model, model_config, dtype, device, max_model_len, gpu_in_use_at_start,
            per_block,
        )
    else:
        budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes ({budget}) is smaller than one KV block "
                f"({per_block} bytes)"
            )
    return KVCacheLayout(num_blocks, per_block)


def _gpu_kv_blocks(
    config: EngineConfig,
    model: LlamaForCausalLM,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    in_use_at_start: tuple[int, int],
    bytes_per_block: int,
) -> int:
    """vLLM's gpu_memory_utilization: what is left after the weights and a profiled
    largest step (engine.worker.gpu_memory)."""
    other, total = in_use_at_start
    weights = torch.cuda.memory_allocated(device)
    num_tokens = min(config.max_num_batched_tokens, max_model_len)
    try:
        peak = profile_peak_activations(
            model, device, dtype, num_tokens, config.max_num_seqs, config.block_size,
        )
    except torch.OutOfMemoryError as exc:
        hidden = model_config.intermediate_size * 4 * num_tokens
        raise out_of_memory("activations", hidden, device) from exc
    profile = GpuMemoryProfile(total, other, weights, peak)
    num_blocks = plan_kv_blocks(profile, config.gpu_memory_utilization, bytes_per_block)
    gib = 2**30
    logger.info(
        "GPU memory: %.2f GiB total x utilization %.2f; in use before start %.2f GiB, "
        "weights %.2f GiB, peak activations %.2f GiB -> KV cache %.2f GiB",
        total / gib, config.gpu_memory_utilization, other / gib, weights / gib,
        peak / gib, num_blocks * bytes_per_block / gib,
    )
    return num_blocks


def plan_sliding_kv(
    config: EngineConfig, model_config: ModelConfig, max_model_len: int, decode_graphs: bool
) -> KVGroupLayout | None:
    """The sliding-window KV groups, or None where the model has none, no context outlasts
    the window (nothing would ever be freed), or a feature that moves or captures one block
    table per request is on (logged)."""
    groups = plan_kv_groups(model_config.layer_windows)
    if groups is None or config.disable_hybrid_kv_cache_manager:
        return None
    if max_model_len <= groups.window:
        return None
    blockers = [name for name, on in (
        ("swap preemption", config.preemption_mode != "recompute"),
        ("the host KV tier", config.enable_prefix_caching
         and bool(config.kv_offloading_size or config.num_host_kv_blocks)),
        ("CUDA graphs", decode_graphs),
    ) if on]
    if blockers:
        logger.info("sliding-window KV freeing off (every layer keeps every block): %s on",
                    ", ".join(blockers))
        return None
    logger.info("sliding-window KV: %d groups of %d layers, window %d: sliding layers keep "
                "only the blocks inside it", groups.num_groups, groups.group_size, groups.window)
    return groups


def size_host_kv(config: EngineConfig, bytes_per_block: int) -> HostLayout:
    return plan_host_layout(
        preemption_mode=config.preemption_mode,
        swap_space_gib=config.swap_space,
        num_swap_blocks=config.num_swap_blocks,
        kv_offloading_size_gib=config.kv_offloading_size,
        num_host_tier_blocks=config.num_host_kv_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        bytes_per_block=bytes_per_block,
    )


def make_kv_manager(
    config: EngineConfig, kv_layout: KVCacheLayout, host_layout: HostLayout,
    groups: KVGroupLayout | None = None,
) -> KVCacheManager:
    """The block manager; a host tier or swap space only where the host layout has blocks."""
    return KVCacheManager(
        kv_layout.num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        host_tier=(
            HostKVTier(host_layout.num_tier_blocks, host_layout.tier_offset)
            if host_layout.num_tier_blocks else None
        ),
        swap=SwapSpace(host_layout.num_swap_blocks) if host_layout.num_swap_blocks else None,
        groups=groups,
        max_step_tokens=config.max_num_batched_tokens,
    )


def log_kv_cache(
    config: EngineConfig,
    dtype: torch.dtype,
    max_model_len: int,
    kv_layout: KVCacheLayout,
    host_layout: HostLayout,
    blocks_per_request: int | None = None,
) -> None:
    """`blocks_per_request`: blocks one request of max_model_len holds at most (with KV
    groups a block is not a token of every layer); None: ceil(max_model_len / block_size)."""
    blocks = kv_layout.num_blocks
    tokens = blocks * config.block_size
    per_request = blocks_per_request or -(-max_model_len // config.block_size)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s); "
        "max concurrency %.2fx at max_model_len %d",
        blocks,
        config.block_size,
        tokens,
        blocks * kv_layout.bytes_per_block / 2**20,
        str(dtype).removeprefix("torch."),
        blocks / per_request,
        max_model_len,
    )
    if host_layout.num_blocks:
        logger.info(
            "host KV memory: %d swap blocks (preemption_mode=%s), %d host-tier blocks, "
            "%.1f MiB", host_layout.num_swap_blocks, config.preemption_mode,
            host_layout.num_tier_blocks,
            host_layout.num_blocks * kv_layout.bytes_per_block / 2**20,
        )


def resolve_max_model_len(model_config: ModelConfig, config: EngineConfig) -> int:
    """The longest sequence the engine accepts: the model's limit, or the configured one when
    smaller (a larger one is a ValueError); without chunked prefill the step budget must hold
    a whole prompt of that length."""
    derived = model_config.max_position_embeddings
    if model_config.sliding_window:
        # Mistral-style whole-model sliding windows are not implemented; stay inside the window.
        derived = min(derived, model_config.sliding_window)
    requested = config.max_model_len
    if requested is not None and requested > derived:
        raise ValueError(
            f"max_model_len ({requested}) is larger than the model allows ({derived})"
        )
    max_len = requested or derived
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_len:
        raise ValueError(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than "
            f"max_model_len ({max_len}); enable chunked prefill or raise the budget"
        )
    return max_len
