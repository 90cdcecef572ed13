"""Moves a step's host-built inputs (engine.worker.input_batch) to the engine's device.

Inputs are built on the host as small int tensors; on CUDA each is copied into pinned memory
and sent with a non-blocking copy, so the transfers queue behind the previous step's kernels
instead of stalling the host. Only what the Triton path reads travels (ids, positions, slot
mapping, sample indices, the unified batch); the CPU attention paths' metadata stays behind,
unused. On CPU nothing moves.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.unified_batch import UnifiedBatch
from engine.worker.input_batch import ModelInput


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def unified_to_device(batch: UnifiedBatch, device: torch.device) -> UnifiedBatch:
    return UnifiedBatch(
        to_device(batch.query_start_loc, device),
        to_device(batch.seq_lens, device),
        to_device(batch.block_tables, device),
    )


def meta_to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    unified = meta.unified
    return replace(
        meta,
        slot_mapping=to_device(meta.slot_mapping, device),
        unified=None if unified is None else unified_to_device(unified, device),
        groups=tuple(meta_to_device(group, device) for group in meta.groups),
    )


def model_input_to_device(batch: ModelInput, device: torch.device) -> ModelInput:
    if device.type == "cpu":
        return batch
    meta = meta_to_device(batch.meta, device)
    return replace(
        batch,
        input_ids=to_device(batch.input_ids, device),
        positions=to_device(batch.positions, device),
        meta=meta,
        sample_indices=to_device(batch.sample_indices, device),
    )
