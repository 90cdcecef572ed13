"""A constraint after the reasoning (reasoning_end), through the offline API: exact.

The tiny model's random weights never write `</think>`, so the marker is taken from its own
unconstrained greedy output: the text of one of its tokens 3 to 6. The reference loop is
transformers' greedy with the gate's rule written out: every token free until the output's
bytes hold the marker, then the grammar's mask (llguidance, as in test_structured_outputs.py).
"""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.torch
import numpy as np
import pytest
import torch
import transformers

from engine import LLM, SamplingParams, StructuredOutputsParams
from kvfleet.contracts.structured_grammar import llguidance_grammar
from kvfleet.text.tokenizer import load_generation_eos_ids
from tests.fixtures.greedy import random_prompts

MAX_TOKENS = 16
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"


@pytest.fixture(scope="module")
def ll_tokenizer(tiny_model_dir: Path) -> llguidance.LLTokenizer:
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    return llguidance.LLTokenizer((tiny_model_dir / "tokenizer.json").read_text(), n_vocab=vocab,
                                  eos_token=load_generation_eos_ids(tiny_model_dir))


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def marker_of(tokenizer: llguidance.LLTokenizer, tokens: list[int]) -> tuple[int, bytes] | None:
    """The first of tokens[2:6] whose text is whole UTF-8: (its index, its bytes)."""
    for index in range(2, 6):
        text = bytes(tokenizer.decode_bytes([tokens[index]]))
        try:
            if text.decode().strip():
                return index, text
        except UnicodeDecodeError:
            continue
    return None


@torch.inference_mode()
def reference(model_dir: Path, model: transformers.PreTrainedModel,
              tokenizer: llguidance.LLTokenizer, prompt: list[int],
              params: StructuredOutputsParams, marker: bytes) -> list[int]:
    vocab = model.config.vocab_size
    eos = load_generation_eos_ids(model_dir)
    matcher = llguidance.LLMatcher(tokenizer, llguidance_grammar(params))
    packed = llguidance.torch.allocate_token_bitmask(1, vocab)
    seen, content = b"", False
    out: list[int] = []
    step = model(torch.tensor([prompt]), use_cache=True)
    while len(out) < MAX_TOKENS:
        logits = step.logits[0, -1].float()
        if content:
            llguidance.torch.fill_next_token_bitmask(matcher, packed, 0)
            bits = np.unpackbits(packed[0].numpy().view(np.uint8), bitorder="little")[:vocab]
            logits[torch.from_numpy(bits == 0)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if content:
            assert matcher.consume_token(token)
        else:
            seen += bytes(tokenizer.decode_bytes([token]))
            content = marker in seen
        if token in eos:
            break
        step = model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def test_the_grammar_starts_after_the_reasoning_end(tiny_model_dir, llm, hf_model,
                                                    ll_tokenizer) -> None:
    prompts = random_prompts(tiny_model_dir, [12, 20, 31, 7], seed=11)
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], free, use_tqdm=False)]
    checked = 0
    for prompt, tokens in zip(prompts, plain, strict=True):
        found = marker_of(ll_tokenizer, tokens)
        if found is None:
            continue
        marker = found[1]
        constraint = StructuredOutputsParams(regex=REGEX, reasoning_end=marker.decode())
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                structured_outputs=constraint)
        got = list(llm.generate([{"prompt_token_ids": prompt}], params,
                                use_tqdm=False)[0].outputs[0].token_ids)
        expected = reference(tiny_model_dir, hf_model, ll_tokenizer, prompt, constraint, marker)
        assert got == expected
        cut = next(i for i in range(len(tokens)) if marker in b"".join(
            bytes(ll_tokenizer.decode_bytes([t])) for t in tokens[:i + 1]))
        assert got[:cut + 1] == tokens[:cut + 1]  # the reasoning is unconstrained greedy
        assert got != tokens  # and the grammar took over after it
        checked += 1
    assert checked >= 2


def test_a_marker_that_never_comes_leaves_the_output_unconstrained(tiny_model_dir, llm) -> None:
    prompts = random_prompts(tiny_model_dir, [9, 25], seed=3)
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    gated = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=(
        StructuredOutputsParams(regex=REGEX, reasoning_end="\u2603 never \u2603")))
    requests = [{"prompt_token_ids": p} for p in prompts]
    assert ([o.outputs[0].token_ids for o in llm.generate(requests, gated, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in llm.generate(requests, free, use_tqdm=False)])
