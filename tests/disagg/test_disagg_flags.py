"""The disaggregation flags: `kvfleet up --prefill-engines/--decode-engines` gives engines
their roles, the engine parses --role and --kv-transfer, the router parses its threshold."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.service.server import build_parser as engine_parser
from engine.service.server import options_from_args
from kvfleet.cli import build_parser, up_config
from kvfleet.fleet import FleetConfig
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
