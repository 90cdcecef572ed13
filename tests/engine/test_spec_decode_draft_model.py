"""Draft-model speculation keeps greedy output equal to transformers' `generate`.

The tiny model as its own draft keeps every draft (acceptance 100%); a draft whose weights
are the target's plus seeded noise disagrees now and then (partial acceptance); a draft with
another vocabulary is refused at start with a message saying so.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine import LLM
from tests.engine.test_spec_decode_exactness import (
    GREEDY,
    NUM_DRAFTS,
    prompts,  # noqa: F401  (module fixtures)
    reference,  # noqa: F401
    run_checked,
    spec_stats,
)
from tests.fixtures.tiny_model import save_random_model, tiny_llama_config


def draft_config(model_dir: Path) -> dict[str, object]:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": NUM_DRAFTS}


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("noisy_draft")
    for item in Path(tiny_model_dir).iterdir():
        shutil.copy(item, out / item.name)
    weights = load_file(str(out / "model.safetensors"))
    generator = torch.Generator().manual_seed(99)
    noisy = {
        name: t + 0.15 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
        for name, t in weights.items()
    }
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({}, id="one-batch"),
        pytest.param({"max_num_batched_tokens": 32}, id="chunked"),
        pytest.param({"num_kv_blocks": 20, "max_num_batched_tokens": 64}, id="preemption"),
    ],
)
def test_self_draft_keeps_every_draft(tiny_model_dir, prompts, reference, engine_args):  # noqa: F811
    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        speculative_config=draft_config(tiny_model_dir),
        **engine_args,
    )
    assert run_checked(llm.engine, prompts, GREEDY) == reference
    stats = spec_stats(llm)
    assert stats["spec_decode_num_draft_tokens"] > 0
    # Drafts cut by the budget or lost to preemption: those verified are all kept.
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    speculator = llm.engine.speculator
    assert speculator is not None
    draft_kv = speculator.proposer.kv  # type: ignore[attr-defined]
    speculator.proposer.propose_for([])  # type: ignore[attr-defined]  # frees finished
    assert draft_kv.num_free_blocks == draft_kv.num_blocks


def test_noisy_draft_partial_acceptance(tiny_model_dir, noisy_draft_dir, prompts, reference):  # noqa: F811
    llm = LLM(tiny_model_dir, dtype="float32", speculative_config=draft_config(noisy_draft_dir))
    assert run_checked(llm.engine, prompts, GREEDY) == reference
    stats = spec_stats(llm)
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    save_random_model(tiny_llama_config(vocab + 8), tmp_path)
    with pytest.raises(ValueError, match=r"draft model vocabulary \(\d+ tokens\) differs"):
        LLM(tiny_model_dir, dtype="float32", speculative_config=draft_config(tmp_path))
