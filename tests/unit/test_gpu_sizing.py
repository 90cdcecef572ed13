"""The CPU-testable arithmetic of the CUDA engine: which decode batch sizes are captured as
CUDA graphs and how a step pads to them (engine.worker.cuda_graphs), and how the KV cache is sized
from gpu_memory_utilization (engine.worker.gpu_memory)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.worker.cuda_graphs import DEFAULT_CAPTURE_SIZES, capture_sizes, padded_size
from engine.worker.gpu_memory import GpuMemoryError, GpuMemoryProfile, plan_kv_blocks

GIB = 2**30


def test_default_capture_sizes_are_vllms_list_cut_at_max_num_seqs():
    assert DEFAULT_CAPTURE_SIZES[:5] == (1, 2, 4, 8, 16)
    assert DEFAULT_CAPTURE_SIZES[-1] == 512
    assert capture_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes(20) == (1, 2, 4, 8, 16)
    assert capture_sizes(3) == (1, 2)


def test_requested_capture_sizes_are_sorted_deduplicated_and_cut():
    assert capture_sizes(10, [8, 1, 8, 64, 3]) == (1, 3, 8)


def test_padded_size_takes_the_smallest_size_that_fits():
    sizes = (1, 2, 4, 8, 16)
    assert [padded_size(sizes, n) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert padded_size(sizes, 17) is None


def test_kv_blocks_are_what_utilization_leaves():
    profile = GpuMemoryProfile(
        total_bytes=80 * GIB, other_bytes=1 * GIB, weights_bytes=2 * GIB,
        peak_activation_bytes=1 * GIB,
    )
    # 0.9 x 80 = 72 GiB allowed; 72 - 1 - 2 - 1 = 68 GiB of 1 MiB blocks.
    assert plan_kv_blocks(profile, 0.9, 2**20) == 68 * 1024
    assert plan_kv_blocks(profile, 0.1, 2**20) == 4 * 1024


def test_no_room_for_kv_names_the_numbers_and_what_to_lower():
    profile = GpuMemoryProfile(8 * GIB, 1 * GIB, 5 * GIB, 2 * GIB)
    with pytest.raises(GpuMemoryError) as err:
        plan_kv_blocks(profile, 0.9, 2**20)
    message = str(err.value)
    for fact in ("0.9", "8.00 GiB", "7.20 GiB", "weights take 5.00 GiB", "2.00 GiB",
                 "--gpu-memory-utilization", "--max-num-batched-tokens"):
        assert fact in message


def test_utilization_out_of_range_is_refused():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(model="m", gpu_memory_utilization=bad)


def test_parameter_count_matches_the_checkpoint(tiny_model_dir):
    from safetensors import safe_open

    from engine.models.config import ModelConfig

    config = ModelConfig.from_dir(tiny_model_dir)
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        stored = sum(_numel(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    assert config.num_parameters == stored


def _numel(shape: list[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
