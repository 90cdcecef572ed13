"""The router's request checks as pure functions: limits, context fit, body parsing, error JSON.

The same checks run over real HTTP and gRPC in test_http_limits.py; here each rule is pinned
with exact inputs, including the flags that turn them.
"""

from __future__ import annotations

import pytest

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.v1 import common_pb2, router_pb2
from router.engines.context_window import check_fits
from router.http.body import decode_json
from router.http.errors import error_body, status_of
from router.openai.requests import ChatCompletionRequest, CompletionRequest, parse_body
from router.request_limits import TOKENIZER_MAX_MESSAGE_BYTES, RequestLimits
from router.server import RouterConfig, parse_args

SMALL = RequestLimits(max_input_chars=10, max_input_tokens=5, max_messages=2,
                      max_stop_sequences=2, max_stop_chars=3, max_choices=4)


def _field(call: object) -> InvalidFieldError:
    assert callable(call)
    with pytest.raises(InvalidFieldError) as info:
        call()
    return info.value


def _request(**fields: object) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(**fields)  # type: ignore[arg-type]


def test_flags_become_the_frozen_limits() -> None:
    args = parse_args(["--tokenizer", "t:1", "--payload-limit", "100", "--body-read-timeout",
                       "1.5", "--max-input-chars", "7", "--max-input-tokens", "6",
                       "--max-messages", "5", "--max-stop-sequences", "4", "--max-stop-chars",
                       "3", "--max-choices", "2"])
    assert RouterConfig.from_args(args).limits == RequestLimits(
        max_body_bytes=100, body_read_timeout_s=1.5, max_input_chars=7, max_input_tokens=6,
        max_messages=5, max_stop_sequences=4, max_stop_chars=3, max_choices=2)
    defaults = RouterConfig.from_args(parse_args(["--tokenizer", "t:1"])).limits
    assert defaults == RequestLimits() and defaults.max_input_tokens is None
    with pytest.raises(ValueError, match="max_messages"):
        RequestLimits(max_messages=0)


def test_sizes_known_before_tokenizing_are_checked_naming_the_field() -> None:
    assert _field(lambda: SMALL.check_request(_request(prompt="x" * 11))).param == "prompt"
    SMALL.check_request(_request(prompt="x" * 10))
    chat = _request(messages=common_pb2.ChatMessages(messages=[
        common_pb2.ChatMessage(role="user", content="x")] * 3))
    assert "3 entries" in str(_field(lambda: SMALL.check_request(chat)))
    chars = _request(messages=common_pb2.ChatMessages(messages=[
        common_pb2.ChatMessage(role="user", content="x" * 7)]))  # 4 + 7 characters
    assert _field(lambda: SMALL.check_request(chars)).param == "messages"
    ids = _request(prompt_token_ids=common_pb2.TokenIds(ids=[1] * 6))
    assert "at most 5 input tokens" in str(_field(lambda: SMALL.check_request(ids)))
    stops = _request(prompt="x", sampling_params=common_pb2.SamplingParams(stop=["a"] * 3))
    assert _field(lambda: SMALL.check_request(stops)).param == "stop"
    long_stop = _request(prompt="x", sampling_params=common_pb2.SamplingParams(stop=["abcd"]))
    assert "stop[0] is 4 characters" in str(_field(lambda: SMALL.check_request(long_stop)))
    n = _request(prompt="x", sampling_params=common_pb2.SamplingParams(n=5))
    assert _field(lambda: SMALL.check_request(n)).param == "n"
    assert _field(lambda: SMALL.check_choices(2, 3)).param == "prompt"


def test_a_prompt_must_fit_the_tokenizer_message() -> None:
    wide = "€" * (TOKENIZER_MAX_MESSAGE_BYTES // 3 + 1)  # 3 bytes each in UTF-8
    limits = RequestLimits(max_input_chars=len(wide))
    error = _field(lambda: limits.check_request(_request(prompt=wide)))
    assert error.param == "prompt" and "bytes in UTF-8" in str(error)


def test_prompt_and_max_tokens_must_fit_the_served_context() -> None:
    check_fits(255, None, 256, "prompt")
    check_fits(200, 56, 256, "prompt")
    full = _field(lambda: check_fits(256, None, 256, "messages"))
    assert full.param == "messages" and "(max_model_len) is 256" in str(full)
    over = _field(lambda: check_fits(200, 57, 256, "prompt"))
    assert over.param == "max_tokens" and "257 tokens (200 in the prompt, 57" in str(over)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
        ({"prompt": "x", "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
         "functions"),
        ({"messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_json": "{"}, "guided_json"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_decoding_backend": "x"},
         "guided_decoding_backend"),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
    ],
)
def test_unimplemented_fields_are_refused_by_name(body: dict[str, object], param: str) -> None:
    cls = ChatCompletionRequest if "messages" in body else CompletionRequest
    error = _field(lambda: parse_body(cls, body, RequestLimits()).to_router_requests())
    assert error.param == param and param.split(".")[-1] in str(error)


def test_their_off_values_and_unknown_fields_are_accepted() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
            "response_format": {"type": "text"}, "modalities": ["text"], "tools": [],
            "parallel_tool_calls": None, "store": False, "metadata": {"a": "b"},
            "some_future_field": 1}
    (request,) = parse_body(ChatCompletionRequest, body, RequestLimits()).to_router_requests()
    assert request.messages.messages[0].content == "x"


def test_pydantic_problems_name_the_field_with_a_path() -> None:
    error = _field(lambda: parse_body(
        ChatCompletionRequest, {"messages": [{"role": "user"}, {"role": "bot"}]},
        RequestLimits()))
    assert error.param == "messages[1].role" and str(error).startswith("messages[1].role: ")
    missing = _field(lambda: parse_body(CompletionRequest, {"n": 2}, RequestLimits()))
    assert missing.param == "prompt" and str(missing) == "prompt is required"
    assert _field(lambda: parse_body(CompletionRequest, [], RequestLimits())).param is None
    ids = _field(lambda: parse_body(CompletionRequest, {"prompt": [[1, 2**32]]},
                                    RequestLimits()).to_router_requests())
    assert ids.param == "prompt[0]"


def test_huge_lists_are_counted_before_they_are_parsed() -> None:
    limits = RequestLimits(max_messages=3, max_choices=3)
    messages = [{"role": "user", "content": "x"}] * 4
    assert _field(lambda: parse_body(ChatCompletionRequest, {"messages": messages},
                                     limits)).param == "messages"
    assert _field(lambda: parse_body(CompletionRequest, {"prompt": ["a"] * 4},
                                     limits)).param == "prompt"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"\xff", "not valid UTF-8 (byte 0xff at offset 0)"),
        (b"  ", "empty"),
        (b"{", "not valid JSON"),
        (b'{"a": Infinity}', "Infinity is not a JSON value"),
        (b'{"a": ' + b"9" * 5000 + b"}", "too many digits"),
    ],
)
def test_bodies_that_are_not_json(raw: bytes, needle: str) -> None:
    error = _field(lambda: decode_json(raw))
    assert needle in str(error) and error.param is None


def test_error_json_and_statuses() -> None:
    assert status_of(InvalidFieldError("stop", "stop has 9 strings")) == (
        400, "stop has 9 strings", "stop")
    assert status_of(InvalidFieldError(None, "too big", 413))[0] == 413
    # The engine's own rules name the field first; it becomes `param`.
    assert status_of(ValueError("temperature must be a non-negative number")) == (
        400, "temperature must be a non-negative number", "temperature")
    assert status_of(ValueError("the chat template rejected the messages"))[2] is None
    assert status_of(RuntimeError("secret"))[:2] == (500, "internal error")
    assert error_body(413, "m", None) == {"error": {
        "message": "m", "type": "RequestTooLargeError", "param": None, "code": 413}}
