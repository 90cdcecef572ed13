"""The committed stubs match proto/ (`scripts/gen_proto.py --check`), the checker catches
stale, missing and orphaned stubs, and the contracts keep the presence semantics the
services rely on (proto3 `optional` where unset differs from zero).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.v1 import common_pb2, engine_pb2, router_pb2, tokenizer_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
GEN_PROTO = REPO_ROOT / "scripts" / "gen_proto.py"


def run_gen_proto(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GEN_PROTO), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_committed_stubs_are_up_to_date():
    result = run_gen_proto("--check")
    assert result.returncode == 0, f"run `make proto`:\n{result.stderr}"


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """proto/ and kvfleet/v1 copied to a scratch root the checker can be pointed at."""
    shutil.copytree(REPO_ROOT / "proto", tmp_path / "proto")
    shutil.copytree(REPO_ROOT / "kvfleet" / "v1", tmp_path / "kvfleet" / "v1")
    return tmp_path


def test_check_reports_stale_missing_and_orphaned_stubs(repo_copy: Path):
    common = repo_copy / "proto" / "kvfleet" / "v1" / "common.proto"
    common.write_text(common.read_text() + "\nmessage Added {}\n")
    (repo_copy / "kvfleet" / "v1" / "engine_pb2.pyi").unlink()
    (repo_copy / "kvfleet" / "v1" / "gone_pb2.py").write_text("# from a deleted proto\n")
    result = run_gen_proto("--check", "--root", str(repo_copy))
    assert result.returncode == 1
    problems = set(result.stderr.splitlines())
    assert "stale: kvfleet/v1/common_pb2.py" in problems
    assert "missing: kvfleet/v1/engine_pb2.pyi" in problems
    assert "orphaned (no .proto): kvfleet/v1/gone_pb2.py" in problems
    assert not any("router" in p for p in problems)  # untouched stubs are not flagged


def test_regeneration_is_deterministic_and_fixes_the_tree(repo_copy: Path):
    (repo_copy / "kvfleet" / "v1" / "gone_pb2.py").write_text("# from a deleted proto\n")
    assert run_gen_proto("--root", str(repo_copy)).returncode == 0
    assert not (repo_copy / "kvfleet" / "v1" / "gone_pb2.py").exists()
    for stub in sorted((REPO_ROOT / "kvfleet" / "v1").glob("*_pb2*")):
        assert (repo_copy / "kvfleet" / "v1" / stub.name).read_bytes() == stub.read_bytes()
    assert run_gen_proto("--check", "--root", str(repo_copy)).returncode == 0


def test_optional_fields_distinguish_unset_from_zero():
    params = common_pb2.SamplingParams()
    for field in (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "max_tokens",
        "skip_special_tokens",
        "n",
        "repetition_penalty",
        "logprobs",
        "top_logprobs",
    ):
        assert not params.HasField(field), field
    params.temperature = 0.0  # greedy, explicitly
    assert params.HasField("temperature")
    assert tokenizer_pb2.TokenizeRequest().HasField("add_special_tokens") is False
    assert engine_pb2.GenerateResponse().HasField("finish_reason") is False
    assert router_pb2.RouterGenerateResponse().HasField("stop_reason") is False


def test_oneofs_select_one_input():
    request = router_pb2.RouterGenerateRequest(prompt="hi")
    request.prompt_token_ids.ids.extend([1, 2])
    assert request.WhichOneof("input") == "prompt_token_ids"
    stop = common_pb2.StopReason(stop_string="###")
    assert stop.WhichOneof("reason") == "stop_string"


def test_services_and_methods():
    def methods(module, name):
        service = module.DESCRIPTOR.services_by_name[name]
        return {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}

    assert methods(tokenizer_pb2, "Tokenizer") == {
        "Tokenize": (False, False),
        "Detokenize": (False, False),
        "DetokenizeStream": (True, True),
        "GetInfo": (False, False),
    }
    assert methods(engine_pb2, "Engine") == {
        "Generate": (False, True),
        "Abort": (False, False),
        "GetLoad": (False, False),
        "LoadLoRAAdapter": (False, False),
        "UnloadLoRAAdapter": (False, False),
        "Prefill": (False, True),
        "ReceiveKV": (True, False),
        "GenerateImported": (False, True),
    }
    assert methods(router_pb2, "Router") == {"Generate": (False, True)}
