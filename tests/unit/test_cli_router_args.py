"""`kvfleet up --router-arg=...` passes router flags through to the router's command line,
and the router accepts the tool-calling flags (vLLM's names)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.cli import build_parser, up_config
from kvfleet.fleet import router_command
from router.server import parse_args


def test_router_args_reach_the_router_command(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "up", "--log-dir", str(tmp_path), "--http-port", "0",
        "--router-arg=--enable-auto-tool-choice", "--router-arg=--tool-call-parser=hermes",
    ])
    config = up_config(args, tmp_path)
    command = router_command(config, "127.0.0.1:1", "redis://x", "prefix", 0)
    assert command[-2:] == ["--enable-auto-tool-choice", "--tool-call-parser=hermes"]
    router = parse_args(["--tokenizer", "t:1", *command[-2:], "--reasoning-parser", "qwen3"])
    assert router.chat_output.enable_auto_tool_choice
    assert router.chat_output.tool_call_parser == "hermes"
    assert router.chat_output.reasoning_parser == "qwen3"


def test_auto_tool_choice_needs_a_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--tokenizer", "t:1", "--enable-auto-tool-choice"])
    assert "requires --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--tokenizer", "t:1", "--tool-call-parser", "nope"])
