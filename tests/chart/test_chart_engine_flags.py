"""The chart's GPU and KV-memory-tier values reach the engine as the engine's own flags.

Each command line is expanded as the kubelet does it and parsed by the engine's real parser
and config builder, so a value the chart passes but the engine reads differently fails here.
The generic tests (lint --strict, strict Kubernetes schemas) cover the same scenarios
(`gpu`, `gpu-eager`, `kv-tiers` in chart_harness.SCENARIOS).
"""

from __future__ import annotations

import argparse

import pytest

from tests.chart.chart_harness import SCENARIOS, command_line, render


def _engine_argv(scenario: str) -> list[str]:
    argv = command_line(render(SCENARIOS[scenario]), "engine")
    assert argv[3:5] == ["serve", "engine"]
    return argv[5:]


def _parse(argv: list[str]) -> argparse.Namespace:
    from engine.service.server import build_parser

    return build_parser().parse_args(argv)


def test_cpu_engines_get_no_gpu_flags() -> None:
    argv = _engine_argv("default")
    assert not [a for a in argv if a.startswith(("--device", "--gpu-memory", "--enforce"))]
    assert "nvidia.com/gpu" not in render().container("engine")["resources"].get("limits", {})


@pytest.mark.parametrize(("scenario", "utilization", "eager"),
                         [("gpu", "0.9", False), ("gpu-eager", "0.75", True)])
def test_gpu_engines_run_on_cuda_with_the_memory_share(scenario: str, utilization: str,
                                                       eager: bool) -> None:
    argv = _engine_argv(scenario)
    assert "--device=cuda" in argv
    assert f"--gpu-memory-utilization={utilization}" in argv
    assert ("--enforce-eager" in argv) == eager
    limits = render(SCENARIOS[scenario]).container("engine")["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == SCENARIOS[scenario]["engine"]["gpu"].get("count", 1)


@pytest.mark.parametrize("scenario", ["gpu", "gpu-eager"])
def test_gpu_command_line_parses(scenario: str) -> None:
    from engine.service.server import options_from_args

    args = _parse(_engine_argv(scenario))
    engine = options_from_args(args).engine
    assert engine.device == "cuda"
    gpu = SCENARIOS[scenario]["engine"]["gpu"]
    assert engine.gpu_memory_utilization == gpu.get("memoryUtilization", 0.9)
    assert engine.enforce_eager == gpu.get("enforceEager", False)


def test_kv_tier_defaults_are_the_engines() -> None:
    from engine.config import EngineConfig
    from engine.service.server import build_parser, options_from_args

    engine = options_from_args(build_parser().parse_args(_engine_argv("default"))).engine
    defaults = {name: EngineConfig.__dataclass_fields__[name].default
                for name in ("preemption_mode", "swap_space", "swap_min_computed_tokens",
                             "kv_offloading_size")}
    assert {name: getattr(engine, name) for name in defaults} == defaults
    assert not [a for a in _engine_argv("default") if a.startswith("--kv-offloading-size")]


def test_kv_tier_values_reach_the_engine_config() -> None:
    from engine.service.server import build_parser, options_from_args

    argv = _engine_argv("kv-tiers")
    assert "--kv-offloading-size=2" in argv
    engine = options_from_args(build_parser().parse_args(argv)).engine
    assert engine.preemption_mode == "auto"
    assert engine.swap_space == 0.5
    assert engine.swap_min_computed_tokens == 128
    assert engine.kv_offloading_size == 2.0


def test_a_kv_tier_change_rolls_only_the_engines() -> None:
    def checksum(values: dict[str, object], component: str) -> str:
        metadata = render(values).workload(component)["spec"]["template"]["metadata"]
        return str(metadata["annotations"]["checksum/config"])

    changed = {c for c in ("router", "tokenizer", "engine")
               if checksum({}, c) != checksum({"engine": {"preemptionMode": "swap"}}, c)}
    assert changed == {"engine"}
