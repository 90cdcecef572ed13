"""`make bench` scenarios E (benchmarks/spec_decode.py) and F (benchmarks/lora_bench.py) run
end to end at smoke size on the tiny model, kvfleet only (`--peers none`; the vLLM worker they
drive is covered by tests/slow/test_vllm_peer.py): each writes its JSON, judges its
kvfleet-only targets and prints its report. Figures mean nothing here; the wiring is checked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import lora_bench, spec_decode


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 2,048-token context (RoPE: no position weights to add): its
    byte-level tokenizer makes E's grounded prompts longer than its 512."""
    copy = tmp_path_factory.mktemp("tiny_2k")
    for path in tiny_model_dir.iterdir():
        if path.is_file():
            shutil.copy(path, copy / path.name)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return copy


def test_spec_decode_smoke_run(model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "spec_decode.json"
    code = spec_decode.main(
        [
            "--model",
            str(model_dir),
            "--peers",
            "none",
            "--num-prompts",
            "1",
            "--rounds",
            "1",
            "--grounded-out",
            "8",
            "--random-out",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert set(results["systems"]) == {
        spec_decode.KV_PLAIN,
        spec_decode.KV_NGRAM,
        spec_decode.KV_DRAFT,
    }
    # Greedy speculation never changes a token.
    for name in (spec_decode.KV_NGRAM, spec_decode.KV_DRAFT):
        for workload in ("grounded", "random"):
            assert (
                results["systems"][name][workload]["outputs"]
                == results["systems"][spec_decode.KV_PLAIN][workload]["outputs"]
            )
    assert [t["label"] for t in results["targets"]] == [
        "E grounded: kvfleet ngram / kvfleet plain",
        "E random: kvfleet ngram / kvfleet plain",
    ]
    printed = capsys.readouterr().out
    assert "== E. speculative decoding" in printed and "targets:" in printed


def test_lora_bench_smoke_run(model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "lora.json"
    code = lora_bench.main(
        [
            "--model",
            str(model_dir),
            "--peers",
            "none",
            "--num-prompts",
            "8",
            "--output-len",
            "4",
            "--rounds",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert set(results["systems"]["kvfleet"]) == {lora_bench.BASE, lora_bench.MIXED}
    assert [t["label"] for t in results["targets"]] == ["F kvfleet 8 adapters / kvfleet base"]
    assert len(list((tmp_path / "lora" / "adapters").iterdir())) == lora_bench.NUM_ADAPTERS
    assert "== F. multi-LoRA" in capsys.readouterr().out
