"""The engine streams its own text: real gRPC over loopback, real Redis, the tiny model.

Covers: text deltas concatenate to the text the generated ids add after the prompt (one
message per step, every delta whole characters); the EOS / stop token that ends generation
adds no text unless include_stop_str_in_output; skip_special_tokens is honoured and no
character is split, and with stop strings a several-token output (speculative decoding) has
the text and per-token ends of one-token outputs (`StreamText` fed crafted outputs, since a
random model's tokens are not chosen); logprob entries (generated and prompt) carry
decode([id]) with special tokens kept, and the first prompt token's text comes with the
prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine.service.engine_state import GenerateOutput
from engine.service.output_text import StreamText
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.redis_server import RedisServer
from kvfleet.text.incremental import REPLACEMENT_CHAR
from kvfleet.text.tokenizer import Tokenizer
from kvfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.fixtures.engine_harness import (
    EngineHarness,
    engine_options,
    gen_request,
    run,
    tokens_of,
)

PROMPT = "Once upon a time there was a small village by the sea"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def stub(tiny_model_dir: Path, redis_server: RedisServer) -> Iterator[engine_pb2_grpc.EngineStub]:
    harness = EngineHarness(engine_options(tiny_model_dir, redis_server.url, "text")).start()
    try:
        with grpc.insecure_channel(harness.address) as channel:
            yield engine_pb2_grpc.EngineStub(channel)
    finally:
        harness.stop()


def text_of(responses: list[engine_pb2.GenerateResponse]) -> str:
    return "".join(r.text_delta for r in responses)


def added_text(tokenizer: Tokenizer, prompt: list[int], generated: list[int],
               skip_special_tokens: bool = True) -> str:
    """What `generated` adds to the prompt's text (the prompt is ASCII: whole characters)."""
    before = tokenizer.decode(prompt, skip_special_tokens)
    after = tokenizer.decode(prompt + generated, skip_special_tokens)
    assert after.startswith(before)
    return after[len(before):]


def test_text_deltas_add_up_to_the_generated_text(stub, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    responses = run(stub, gen_request("text-1", prompt, 48))
    generated = tokens_of(responses)
    assert len(responses) == 48  # one message per step, text or not
    full = added_text(tokenizer, prompt, generated)
    assert text_of(responses) == full and full
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in r.text_delta for r in responses)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_adds_text_only_with_include_stop_str_in_output(stub, tokenizer, include):
    prompt = tokenizer.encode(PROMPT)
    expected = tokens_of(run(stub, gen_request(f"free-{include}", prompt, 8)))
    stop_id = expected[4]
    generated = expected[: expected.index(stop_id) + 1]
    responses = run(stub, gen_request(f"stop-{include}", prompt, 8, stop_token_ids=[stop_id],
                                      include_stop_str_in_output=include))
    assert responses[-1].finish_reason == "stop" and tokens_of(responses) == generated
    text_ids = generated if include else generated[:-1]
    assert text_of(responses) == added_text(tokenizer, prompt, text_ids)


def outputs(ids: list[int], finish_reason: str = "length") -> list[GenerateOutput]:
    """One engine output per id, the last one finished."""
    last = len(ids) - 1
    return [GenerateOutput("r", [token_id], i == last, finish_reason if i == last else None)
            for i, token_id in enumerate(ids)]


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_decides_whether_special_tokens_show(tokenizer, skip):
    ids = [*tokenizer.encode("Hello"), 0, *tokenizer.encode(" world")]  # 0: <|endoftext|>
    text = StreamText(tokenizer, tokenizer.encode(PROMPT), SamplingParams(
        skip_special_tokens=skip))
    deltas = [text.delta(output).text for output in outputs(ids)]
    assert "".join(deltas) == ("Hello world" if skip else "Hello<|endoftext|> world")


def test_multibyte_characters_are_never_split(tokenizer):
    ids = tokenizer.encode("café 東京 🙂 naïve")
    # Some characters span tokens: such a token decodes to U+FFFD on its own.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([token_id]) for token_id in ids)
    text = StreamText(tokenizer, tokenizer.encode(PROMPT), SamplingParams())
    deltas = [text.delta(output).text for output in outputs(ids)]
    assert "".join(deltas) == "café 東京 🙂 naïve"
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def grouped(ids: list[int], sizes: list[int], finish_reason: str) -> list[GenerateOutput]:
    """Outputs of `sizes` tokens each (as speculation sends them), the last one finished."""
    out, start = [], 0
    for n, size in enumerate(sizes):
        last = n == len(sizes) - 1
        out.append(GenerateOutput("r", ids[start : start + size], last,
                                  finish_reason if last else None))
        start += size
    assert start == len(ids)
    return out


@pytest.mark.parametrize("finish_reason", ["length", "stop"])
def test_several_token_outputs_end_each_token_text_where_one_token_outputs_do(
    tokenizer, finish_reason
):
    # Multi-byte characters span tokens, so some tokens add no text on their own; with
    # finish_reason "stop" the last id is the EOS, which adds none either.
    ids = [*tokenizer.encode("café 東京 🙂 naïve, the end"), 0]
    params = SamplingParams(stop=["zzz"])
    one = StreamText(tokenizer, tokenizer.encode(PROMPT), params)
    singles = [one.delta(output).text for output in outputs(ids, finish_reason)]
    assert any(single == "" for single in singles[:-1])
    sizes = [3, 1, 4, 2, len(ids) - 10]
    several = StreamText(tokenizer, tokenizer.encode(PROMPT), params)
    start = 0
    for output in grouped(ids, sizes, finish_reason):
        delta = several.delta(output)
        pieces = singles[start : start + len(output.token_ids)]
        start += len(output.token_ids)
        assert delta.text == "".join(pieces)
        expected_ends = [len("".join(pieces[: i + 1])) for i in range(len(pieces))]
        assert delta.token_ends == (expected_ends if len(pieces) > 1 else [])
    # Without stop strings a several-token output is one decode, and carries no ends.
    plain = StreamText(tokenizer, tokenizer.encode(PROMPT), SamplingParams())
    deltas = [plain.delta(output) for output in grouped(ids, sizes, finish_reason)]
    assert "".join(d.text for d in deltas) == "".join(singles)
    assert all(d.token_ends == [] for d in deltas)


def test_logprobs_carry_decoded_tokens(stub, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    responses = run(stub, gen_request("lp-1", prompt, 6, logprobs=3, prompt_logprobs=2))

    def check(entry: common_pb2.TokenLogprobs) -> None:
        for lp in (entry.sampled, *entry.top):
            assert lp.decoded_token == tokenizer.decode([lp.token_id], skip_special_tokens=False)

    first = responses[0]
    assert first.first_prompt_token_text == tokenizer.decode([prompt[0]], False)
    assert [e.sampled.token_id for e in first.prompt_logprobs] == prompt[1:]
    entries = [e for r in responses for e in r.logprobs]
    assert len(entries) == 6 and all(len(e.top) == 3 for e in entries)
    for entry in (*first.prompt_logprobs, *entries):
        check(entry)
    assert not any(r.first_prompt_token_text for r in responses[1:])
