"""OpenAI bodies -> router requests, choice numbering and usage, and HTTP statuses: pure."""

from __future__ import annotations

import pytest

from kvfleet.contracts.errors import NotFoundError, OverloadedError, UnavailableError
from kvfleet.v1 import router_pb2
from router.http.app import status_of
from router.openai.render import Choices
from router.openai.requests import ChatCompletionRequest, CompletionRequest
from router.tenancy.api_keys import AuthenticationError


def test_completion_defaults_and_extra_fields() -> None:
    (request,) = CompletionRequest(prompt="hi", top_k=5, repetition_penalty=1.2, seed=3,
                                   stop="##", ignore_eos=True).to_router_requests()
    params = request.sampling_params
    assert request.prompt == "hi"
    assert params.max_tokens == 16  # OpenAI's completions default
    assert not params.HasField("temperature")  # engine default 1.0 applies
    assert params.top_k == 5 and params.seed == 3 and params.ignore_eos
    assert params.repetition_penalty == pytest.approx(1.2)
    assert list(params.stop) == ["##"]
    assert not params.HasField("logprobs")


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    (request,) = CompletionRequest(prompt="hi", echo=True, logprobs=2).to_router_requests()
    assert request.sampling_params.prompt_logprobs == 2
    (plain,) = CompletionRequest(prompt="hi", logprobs=2).to_router_requests()
    assert not plain.sampling_params.HasField("prompt_logprobs")


def test_completion_batches_of_prompts_and_token_ids() -> None:
    requests = CompletionRequest(prompt=["a", "b"], n=2).to_router_requests()
    assert [r.prompt for r in requests] == ["a", "b"]
    assert all(r.sampling_params.n == 2 for r in requests)
    (ids,) = CompletionRequest(prompt=[5, 6, 7]).to_router_requests()
    assert list(ids.prompt_token_ids.ids) == [5, 6, 7]
    (nested,) = CompletionRequest(prompt=[[8, 9]]).to_router_requests()
    assert list(nested.prompt_token_ids.ids) == [8, 9]


def test_chat_max_tokens_unset_means_rest_of_context_and_top_logprobs_fold() -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]}],
        logprobs=True, top_logprobs=4)
    (request,) = body.to_router_requests()
    assert not request.sampling_params.HasField("max_tokens")
    assert request.sampling_params.logprobs == 4
    assert request.messages.messages[0].content == "hello"
    (capped,) = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                      max_completion_tokens=7).to_router_requests()
    assert capped.sampling_params.max_tokens == 7


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (CompletionRequest(prompt="x", logit_bias={"1": 2.0}), "logit_bias"),
        (CompletionRequest(prompt="x", suffix="y"), "suffix"),
        (CompletionRequest(prompt="x", best_of=3), "best_of"),
        (CompletionRequest(prompt=""), "prompt"),
        (CompletionRequest(prompt="x", stream_options={"include_usage": True}), "stream_options"),
        (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=1),
         "top_logprobs"),
        (ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "messages[0].content"),
    ],
)
def test_unsupported_or_inconsistent_fields_are_refused_by_name(body, needle) -> None:
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        body.to_router_requests()


def test_status_codes_follow_openai() -> None:
    assert status_of(ValueError("bad"))[0] == 400
    assert status_of(AuthenticationError("key"))[0] == 401
    assert status_of(NotFoundError("model"))[0] == 404
    assert status_of(OverloadedError("full"))[0] == 429
    assert status_of(UnavailableError("none"))[0] == 503


def _final(index: int, text: str, tokens: int, prompt: int, cached: int):
    response = router_pb2.RouterGenerateResponse(
        index=index, text_delta=text, token_ids=list(range(tokens)), finish_reason="length",
        num_cached_tokens=cached)
    response.usage.prompt_tokens = prompt
    response.usage.completion_tokens = tokens
    return response


def test_choices_number_by_prompt_then_sample_and_count_prompts_once() -> None:
    choices = Choices(n=2, kind="completion")
    choices.add(1, _final(1, "d", 3, 10, 0))
    choices.add(0, _final(0, "a", 2, 7, 0))
    choices.add(0, _final(1, "b", 2, 7, 0))
    choices.add(1, _final(0, "c", 3, 10, 0))
    body = choices.completion_body("cmpl-1", "m", 0)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert body["usage"]["prompt_tokens"] == 17
    assert body["usage"]["completion_tokens"] == 10
    assert body["usage"]["total_tokens"] == 27
