"""The default model's GGUF (Q4_1) served directly equals transformers loading the same GGUF
(dequantized to float32), greedy token for token in float32, through `LLM`, on chat prompts,
under chunked prefill (a 32-token budget: every prompt takes several steps) and again with
prefix hits. One engine, to keep the tier's time down."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.models.default_model import gguf_path
from engine.quant.gguf_model import QuantLlamaForCausalLM
from tests.fixtures.greedy import transformers_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name three primary colors."}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf() -> Path:
    return gguf_path()


@pytest.fixture(scope="module")
def llm(gguf: Path) -> LLM:
    return LLM(str(gguf), dtype="float32", max_num_batched_tokens=32, max_model_len=512)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode(tokenizer.apply_chat_template(c, add_generation_prompt=True),
                             add_special_tokens=False) for c in CHATS]


@pytest.fixture(scope="module")
def reference(gguf: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(gguf.parent, prompts, NEW_TOKENS, gguf_file=gguf.name)


def _run(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_gguf_greedy_matches_transformers_chunked_and_prefix_hits(llm, prompts, reference):
    assert isinstance(llm.engine.model, QuantLlamaForCausalLM)
    first, second = _run(llm, prompts), _run(llm, prompts)
    assert [o.outputs[0].token_ids for o in first] == reference
    assert [o.outputs[0].token_ids for o in second] == reference
    assert all(o.num_cached_tokens > 0 for o in second)


def test_gguf_chat_text(llm):
    out = llm.chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text
