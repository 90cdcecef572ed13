"""Device and attention-backend resolution (engine.worker.device), without needing a GPU: CUDA's
presence is injected."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.service.server import build_parser, options_from_args
from engine.worker.device import (
    DeviceUnavailableError,
    resolve_attention_backend,
    resolve_device,
)


def yes() -> bool:
    return True


def no() -> bool:
    return False


def test_auto_follows_cuda_availability():
    assert resolve_device("auto", cuda_available=no) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=yes) == torch.device("cuda")
    assert resolve_device("cuda:1", cuda_available=yes, cuda_count=lambda: 2) == torch.device(
        "cuda:1"
    )


@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_cuda_without_gpu_says_so(spec):
    with pytest.raises(DeviceUnavailableError, match="no CUDA GPU is visible.*--device cpu"):
        resolve_device(spec, cuda_available=no)


def test_cuda_index_out_of_range():
    with pytest.raises(DeviceUnavailableError, match="only 1 CUDA device"):
        resolve_device("cuda:3", cuda_available=yes, cuda_count=lambda: 1)


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "CUDA", "cuda:x", ""])
def test_bad_spec_is_a_config_error(spec):
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(model="m", device=spec)


def test_attention_backend_by_device():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention_backend("auto", cuda) == "triton"
    assert resolve_attention_backend("triton", cuda) == "triton"
    assert resolve_attention_backend("auto", cpu) == "auto"
    assert resolve_attention_backend("triton", cpu) == "triton"
    for cpu_only in ("cpu_kernel", "torch"):
        with pytest.raises(ValueError, match="CPU path"):
            resolve_attention_backend(cpu_only, cuda)


def test_engine_flags_reach_the_config():
    args = build_parser().parse_args(
        ["--model", "m", "--engine-id", "e", "--redis-url", "redis://127.0.0.1:1/0",
         "--device", "cpu", "--attention-backend", "triton"]
    )
    engine = options_from_args(args).engine
    assert (engine.device, engine.attention_backend) == ("cpu", "triton")
    assert (engine.gpu_memory_utilization, engine.enforce_eager) == (0.9, False)
    args = build_parser().parse_args(
        ["--model", "m", "--engine-id", "e", "--redis-url", "redis://127.0.0.1:1/0",
         "--device", "cuda:1", "--gpu-memory-utilization", "0.5", "--enforce-eager"]
    )
    engine = options_from_args(args).engine
    assert (engine.device, engine.gpu_memory_utilization, engine.enforce_eager) == (
        "cuda:1", 0.5, True)


def test_cpu_linear_backends_are_refused_on_cuda(tmp_path, monkeypatch):
    from engine.core.llm_engine import LLMEngine

    (tmp_path / "config.json").write_text("{}")  # never read: the checks come first
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="CPU path"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", linear_backend="panel"))


def test_llm_engine_reports_missing_gpu_before_loading(tmp_path, monkeypatch):
    from engine.core.llm_engine import LLMEngine

    (tmp_path / "config.json").write_text("{}")  # never read: the device check comes first
    monkeypatch.setattr(torch.cuda, "is_available", no)
    with pytest.raises(DeviceUnavailableError, match="no CUDA GPU"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cuda"))


def test_cpu_kernel_is_the_backend_name_and_kernel_its_alias():
    assert EngineConfig(model="m", attention_backend="cpu_kernel").attention_backend == (
        "cpu_kernel")
    assert EngineConfig(model="m", attention_backend="kernel").attention_backend == "cpu_kernel"
    with pytest.raises(ValueError, match="cpu_kernel"):
        EngineConfig(model="m", attention_backend="cuda_kernel")
