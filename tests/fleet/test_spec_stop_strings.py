"""Stop strings end token ids, logprobs and usage where the text ends, with speculation too.

A real fleet (Redis, tokenizer, router and two engines as processes, real gRPC) on the tiny
model, routed round robin: engine-0 speculates with n-gram lookup, engine-1 decodes plainly.
With speculation one engine message may carry several tokens. When a stop string is
completed by a token inside such a message, the router must end token_ids, logprobs and
usage at that token (vLLM: the token completing the stop string is the last one kept), so
the same request gives the same tokens, usage, logprobs and text on both engines. The
prompts are ones where n-gram drafts are accepted on the seeded tiny model; the test checks
that the message the stop string lands in really carried tokens past it, so it cannot pass
without speculation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfleet.router_client import build_request
from kvfleet.text.incremental import IncrementalDetokenizer
from kvfleet.text.tokenizer import Tokenizer
from kvfleet.v1 import common_pb2, router_pb2
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import RouterClient

pytestmark = pytest.mark.timeout(240)

SPECULATING, PLAIN = "engine-0", "engine-1"
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
# Prompts whose greedy output on the tiny model accepts an n-gram draft early (found by
# search); the first one with a usable stop string is used.
PROMPTS = [
    "cache time village upon of time brown time time upon sixteen lazy",
    "brown once there time jumps once fox a jumps holds tokens there",
    "quick brown village sixteen a village holds was dog by holds quick",
]
MAX_TOKENS = 24
MAX_STOP_CHARS = 6


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 2,
        "policy": "round_robin",
        "engine_args": ("--num-kv-blocks", "128", "--dtype", "float32"),
        "engine_args_by_index": (("--speculative-config", json.dumps(NGRAM)),),
        "engine_threads": 1,
    }


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def on_engine(
    client: RouterClient, engine_id: str, prompt_ids: list[int], **params: object
) -> list[router_pb2.RouterGenerateResponse]:
    """The stream of the request as served by `engine_id` (round robin: within two tries)."""
    sampling = common_pb2.SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        **params,  # type: ignore[arg-type]
    )
    for _ in range(3):
        responses = list(client.stream(build_request(prompt_token_ids=prompt_ids, params=sampling)))
        if responses[-1].engine_id == engine_id:
            return responses
    raise AssertionError(f"round robin never reached {engine_id}")


@dataclass(frozen=True)
class StopCase:
    prompt_ids: list[int]
    stop: str
    # Tokens up to the one completing the stop string, and the end of its message.
    num_kept: int
    message_end: int


def stop_inside_a_message(
    tokenizer: Tokenizer, prompt_ids: list[int], responses: list[router_pb2.RouterGenerateResponse]
) -> StopCase | None:
    """A stop string first completed by a token that is not the last of its message."""
    ids = [t for r in responses for t in r.token_ids]
    # Each token's text as one-token messages would carry it (the engine's detokenizer).
    detokenizer = IncrementalDetokenizer(tokenizer, True, prompt_ids)
    ends, text = [], ""
    for token in ids:
        text += detokenizer.add_tokens([token])
        ends.append(len(text))
    start = 0
    for response in responses:
        size = len(response.token_ids)
        for index in range(start, start + size - 1):  # not the message's last token
            end = ends[index]
            if end == (ends[index - 1] if index else 0):
                continue  # this token adds no text (yet): it completes nothing
            for length in range(1, min(MAX_STOP_CHARS, end) + 1):
                stop = text[end - length : end]
                if "\ufffd" not in stop and text.find(stop) + length == end:  # first here
                    return StopCase(prompt_ids, stop, index + 1, start + size)
        start += size
    return None


@pytest.fixture(scope="module")
def case(client: RouterClient, tokenizer: Tokenizer) -> StopCase:
    sizes: list[list[int]] = []
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        responses = on_engine(client, SPECULATING, prompt_ids)
        sizes.append([len(r.token_ids) for r in responses])
        found = stop_inside_a_message(tokenizer, prompt_ids, responses)
        if found is not None:
            return found
    raise AssertionError(f"no message of several tokens with a usable stop string: {sizes}")


def test_the_plain_engine_sends_one_token_per_message(client: RouterClient, case: StopCase) -> None:
    responses = on_engine(client, PLAIN, case.prompt_ids)
    assert {len(r.token_ids) for r in responses[:-1]} == {1}


def summary(responses: list[router_pb2.RouterGenerateResponse]) -> dict[str, object]:
    final = responses[-1]
    return {
        "text": "".join(r.text_delta for r in responses),
        "token_ids": [t for r in responses for t in r.token_ids],
        "logprob_ids": [lp.sampled.token_id for r in responses for lp in r.logprobs],
        "top_ids": [[t.token_id for t in lp.top] for r in responses for lp in r.logprobs],
        "finish_reason": final.finish_reason,
        "stop_string": final.stop_reason.stop_string,
        "usage": (
            final.usage.prompt_tokens,
            final.usage.completion_tokens,
            final.usage.total_tokens,
        ),
    }


def logprob_values(responses: list[router_pb2.RouterGenerateResponse]) -> list[float]:
    return [lp.sampled.logprob for r in responses for lp in r.logprobs]


@pytest.mark.parametrize("include", [False, True], ids=["stop-excluded", "stop-included"])
def test_a_stop_string_inside_a_message_ends_tokens_usage_and_logprobs_there(
    client: RouterClient, case: StopCase, include: bool
) -> None:
    params = {"stop": [case.stop], "include_stop_str_in_output": include, "logprobs": 2}
    speculated = on_engine(client, SPECULATING, case.prompt_ids, **params)
    plain = on_engine(client, PLAIN, case.prompt_ids, **params)
    got, expected = summary(speculated), summary(plain)
    assert expected["finish_reason"] == "stop" and expected["stop_string"] == case.stop
    assert len(expected["token_ids"]) == case.num_kept < case.message_end  # type: ignore[arg-type]
    assert str(expected["text"]).endswith(case.stop) == include
    assert got == expected
    assert logprob_values(speculated) == pytest.approx(logprob_values(plain), abs=1e-4)


def test_min_tokens_is_counted_token_by_token_inside_a_message(
    client: RouterClient, case: StopCase
) -> None:
    # The stop string's first occurrence is completed before min_tokens tokens exist, in the
    # message whose next token reaches min_tokens: that occurrence must not count.
    params = {"stop": [case.stop], "min_tokens": case.num_kept + 1}
    got = summary(on_engine(client, SPECULATING, case.prompt_ids, **params))
    expected = summary(on_engine(client, PLAIN, case.prompt_ids, **params))
    assert len(expected["token_ids"]) > case.num_kept  # type: ignore[arg-type]
    assert got == expected
