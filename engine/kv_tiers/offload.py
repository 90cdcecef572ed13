"""Host memory for KV blocks (swap space + the prefix cache's host tier) and its copies.

Role: the torch side of the KV memory tiers. `plan_host_layout` turns the engine flags into
block counts once at start; `HostKVBuffer` owns one host tensor per layer, shaped like the
device cache ([2, num_host_blocks, block_size, num_kv_heads, head_dim]; pinned memory when the
device cache is on CUDA) and applies a step's `TransferPlan` with one batched copy per layer
per direction: `index_select` of the source blocks, `index_copy_` into the destination ones.

Invariants: to-host copies run before to-device copies (engine.kv_tiers.transfer); block axis
is dim 1 of every cache tensor; on a CPU-only machine the host buffer is a separate tensor, so
the copies are real and the code path is the one a GPU takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_tiers.transfer import HostLayout, TransferPlan

GIB = 1 << 30


def plan_host_layout(
    *,
    preemption_mode: str,
    swap_space_gib: float,
    num_swap_blocks: int | None,
    kv_offloading_size_gib: float | None,
    num_host_tier_blocks: int | None,
    enable_prefix_caching: bool,
    bytes_per_block: int,
) -> HostLayout:
    """Block counts of both host pools; 0 where a pool is off (recompute mode, no tier)."""
    swap = 0
    if preemption_mode != "recompute":
        swap = num_swap_blocks if num_swap_blocks is not None else int(
            swap_space_gib * GIB // bytes_per_block
        )
    tier = 0
    if enable_prefix_caching:
        if num_host_tier_blocks is not None:
            tier = num_host_tier_blocks
        elif kv_offloading_size_gib:
            tier = int(kv_offloading_size_gib * GIB // bytes_per_block)
    return HostLayout(num_swap_blocks=swap, num_tier_blocks=tier)


@dataclass
class TransferStats:
    bytes_to_host: int = 0
    bytes_to_device: int = 0


class HostKVBuffer:
    def __init__(self, device_caches: list[torch.Tensor], num_blocks: int) -> None:
        self.device_caches = device_caches
        first = device_caches[0]
        pin = first.device.type == "cuda"
        self.host_caches = [
            torch.zeros(
                (cache.shape[0], num_blocks, *cache.shape[2:]), dtype=cache.dtype, pin_memory=pin
            )
            for cache in device_caches
        ]
        self.bytes_per_block = sum(c[:, 0].numel() * c.element_size() for c in device_caches)
        self.stats = TransferStats()

    @torch.inference_mode()
    def apply(self, plan: TransferPlan) -> None:
        if plan.to_host_device_ids:
            self._copy(plan.to_host_device_ids, plan.to_host_host_ids, to_host=True)
            self.stats.bytes_to_host += len(plan.to_host_device_ids) * self.bytes_per_block
        if plan.to_device_host_ids:
            self._copy(plan.to_device_host_ids, plan.to_device_device_ids, to_host=False)
            self.stats.bytes_to_device += len(plan.to_device_host_ids) * self.bytes_per_block

    def _copy(self, src_ids: tuple[int, ...], dst_ids: tuple[int, ...], *, to_host: bool) -> None:
        device = self.device_caches[0].device
        src_index = torch.tensor(src_ids, dtype=torch.int64)
        dst_index = torch.tensor(dst_ids, dtype=torch.int64)
        if to_host:
            src_index = src_index.to(device)
        else:
            dst_index = dst_index.to(device)
        pairs = zip(self.device_caches, self.host_caches, strict=True)
        for device_cache, host_cache in pairs:
            src, dst = (device_cache, host_cache) if to_host else (host_cache, device_cache)
            # One gather of every block for this layer, one move, one scatter.
            blocks = src.index_select(1, src_index).to(dst.device)
            dst.index_copy_(1, dst_index, blocks)
