"""`kvfleet up --model FILE.gguf`: the engines get the file, the tokenizer service its
companion directory (engine.quant.gguf_file), and both the same served model name."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.fleet import FleetConfig, engine_command, tokenizer_command


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_gguf_fleet_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    companion = tmp_path / "companion"
    monkeypatch.setattr("engine.quant.gguf_file.companion_dir", lambda path: companion)
    config = FleetConfig(model_dir=gguf)
    engine = engine_command(config, "engine-0", "redis://x")
    tokenizer = tokenizer_command(config)
    assert _arg(engine, "--model") == str(gguf)
    assert _arg(tokenizer, "--model") == str(companion)
    assert _arg(engine, "--served-model-name") == _arg(tokenizer, "--served-model-name") == \
        "model.Q4_1.gguf"
