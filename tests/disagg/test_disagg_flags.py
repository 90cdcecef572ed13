"""The disaggregation flags: `kvfleet up --prefill-engines/--decode-engines` gives engines
their roles, the engine parses --role and --kv-transfer, the router parses its threshold."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from engine.service.server import build_parser as engine_parser
from engine.service.server import options_from_args
from kvfleet.cli import build_parser, up_config
from kvfleet.fleet import FleetConfig, _shim_code
from kvfleet.fleet_config import DEFAULT_PREFILL_NICE, parse_engine_cpus
from router.engines.disagg import DisaggConfig
from router.server import RouterConfig, parse_args


def test_up_gives_engines_their_roles(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "up", "--log-dir", str(tmp_path), "--http-port", "0",
        "--prefill-engines", "2", "--decode-engines", "1",
    ])
    config = up_config(args, tmp_path)
    assert config.engine_roles == ("prefill", "prefill", "decode")
    assert FleetConfig(model_dir=tmp_path, num_engines=3).engine_roles == ("both",) * 3
    with pytest.raises(ValueError, match="prefill and decode"):
        FleetConfig(model_dir=tmp_path, prefill_engines=1)


def test_up_gives_each_role_its_own_engine_flags(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "up", "--log-dir", str(tmp_path), "--http-port", "0", "--prefill-engines", "1",
        "--decode-engines", "1", "--engine-arg=--max-num-batched-tokens=2048",
        "--prefill-engine-arg=--max-num-batched-tokens=256",
        "--decode-engine-arg=--max-prefill-tokens-per-decode-step=8",
    ])
    config = up_config(args, tmp_path)
    assert config.engine_own_args(0) == ("--max-num-batched-tokens=256", "--role", "prefill")
    assert config.engine_own_args(1) == ("--max-prefill-tokens-per-decode-step=8",
                                         "--role", "decode")
    # The engine's parser sees the role's flag last, so it wins over the fleet-wide one.
    prefill = engine_parser().parse_args(
        ["--model", "m", "--engine-id", "e", "--redis-url", "redis://x",
         *config.engine_args, *config.engine_own_args(0)])
    assert prefill.max_num_batched_tokens == 256 and prefill.role == "prefill"
    by_index = replace(config, engine_args_by_index=((), ("--seed", "3")))
    assert by_index.engine_own_args(1)[-4:] == ("--seed", "3", "--role", "decode")
    colocated = FleetConfig(model_dir=tmp_path, engine_args_by_index=(("--seed", "1"),))
    assert colocated.engine_own_args(0) == ("--seed", "1")
    assert colocated.engine_own_args(1) == ()
    with pytest.raises(ValueError, match=r"prefill_engine_args \(--prefill-engine-arg\)"):
        FleetConfig(model_dir=tmp_path, prefill_engine_args=("--seed", "1"))
    with pytest.raises(ValueError, match="decode_engine_args"):
        FleetConfig(model_dir=tmp_path, decode_engine_args=("--seed", "1"))


def test_engine_and_router_flags() -> None:
    args = engine_parser().parse_args(
        ["--model", "m", "--engine-id", "e", "--redis-url", "redis://x", "--role", "decode"])
    assert args.role == "decode"
    assert options_from_args(args).kv_transfer == "auto"
    args = engine_parser().parse_args(
        ["--model", "m", "--engine-id", "e", "--redis-url", "redis://x", "--kv-transfer", "grpc"])
    assert options_from_args(args).kv_transfer == "grpc"
    with pytest.raises(SystemExit):
        engine_parser().parse_args(
            ["--model", "m", "--engine-id", "e", "--redis-url", "redis://x", "--kv-transfer", "x"])
    with pytest.raises(SystemExit):
        engine_parser().parse_args(
            ["--model", "m", "--engine-id", "e", "--redis-url", "redis://x", "--role", "x"])
    router = RouterConfig.from_args(parse_args([
        "--tokenizer", "t:1", "--disagg-prefill-threshold", "512",
        "--disagg-transfer-timeout", "5"]))
    assert router.disagg == DisaggConfig(512, 5.0)


def test_up_prefill_nice_and_engine_cpus(tmp_path: Path) -> None:
    assert parse_engine_cpus("0|1,2|3-4") == ((0,), (1, 2), (3, 4))
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    args = build_parser().parse_args([
        "up", "--log-dir", str(tmp_path), "--http-port", "0", "--prefill-engines", "1",
        "--decode-engines", "2", "--prefill-nice", "7", "--engine-cpus", f"{cpu}|{cpu}",
    ])
    config = up_config(args, tmp_path)
    assert [config.engine_nice(i) for i in range(3)] == [7, 0, 0]
    assert [config.engine_cpu_set(i) for i in range(3)] == [(cpu,), (cpu,), ()]
    default = up_config(build_parser().parse_args(
        ["up", "--log-dir", str(tmp_path), "--http-port", "0"]), tmp_path)
    assert default.prefill_nice == DEFAULT_PREFILL_NICE and default.engine_cpus == ()
    assert default.engine_nice(0) == 0  # colocated engines are never niced
    with pytest.raises(ValueError, match="prefill_nice"):
        FleetConfig(model_dir=tmp_path, prefill_nice=20)
    with pytest.raises(ValueError, match="engine_cpus"):
        FleetConfig(model_dir=tmp_path, engine_cpus=((0,), (-1,)))


def test_bad_prefill_nice_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--prefill-nice", "20"])
    assert "--prefill-nice" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["a|1", "0-|1", "3-1", "0||1"])
def test_bad_engine_cpus_name_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--engine-cpus"):
        parse_engine_cpus(text)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_child_shim_applies_nice_and_cpus() -> None:
    """The fleet's child shim lowers priority and binds CPUs before exec, so the service's
    every thread inherits them."""
    cpu = min(os.sched_getaffinity(0))
    probe = "import os; print(os.nice(0), sorted(os.sched_getaffinity(0)))"
    before = os.nice(0)
    out = subprocess.run(
        [sys.executable, "-c", _shim_code([sys.executable, "-c", probe], 5, (cpu,))],
        capture_output=True, text=True, check=True, timeout=60).stdout.split(maxsplit=1)
    assert int(out[0]) == min(19, before + 5)
    assert out[1].strip() == f"[{cpu}]"
    plain = subprocess.run([sys.executable, "-c", _shim_code([sys.executable, "-c", probe])],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    assert int(plain.split()[0]) == before


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity")
                    or len(os.sched_getaffinity(0)) < 2, reason="Linux, two CPUs")
def test_services_keep_off_decoding_engines_cpus(tmp_path: Path) -> None:
    host = sorted(os.sched_getaffinity(0))
    first, second = host[:2]
    disagg = FleetConfig(model_dir=tmp_path, prefill_engines=1, decode_engines=1,
                         engine_cpus=((first,), (second,)))
    # The router goes where the prefill engine is, never onto the decode engine's CPU.
    assert disagg.service_cpus() == tuple(cpu for cpu in host if cpu != second)
    decode_on_first = FleetConfig(model_dir=tmp_path, prefill_engines=1, decode_engines=1,
                                  engine_cpus=((second,), (first,)))
    assert decode_on_first.service_cpus() == tuple(cpu for cpu in host if cpu != first)
    with pytest.raises(ValueError, match=r"engine_cpus\[1\].*not among"):
        FleetConfig(model_dir=tmp_path, engine_cpus=((first,), (max(host) + 1,)))
    assert FleetConfig(model_dir=tmp_path).service_cpus() == ()  # nothing bound: float
    every = FleetConfig(model_dir=tmp_path, num_engines=1, engine_cpus=(tuple(host),))
    assert every.service_cpus() == ()  # no CPU left over: float rather than starve
