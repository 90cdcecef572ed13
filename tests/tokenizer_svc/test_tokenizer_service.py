"""The tokenizer service over real gRPC on loopback (tiny model; SmolLM2 in the slow tier).

Results must equal `kvfleet.text.tokenizer.Tokenizer` exactly; bad input must come back as
INVALID_ARGUMENT with a message naming the field, and the server must keep serving.
"""

from __future__ import annotations

import json
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvfleet.text.incremental import REPLACEMENT_CHAR
from kvfleet.text.tokenizer import Tokenizer, load_generation_eos_ids
from kvfleet.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.server import build_server

TIMEOUT_S = 30
CHAT = [("system", "You are terse."), ("user", "Où est le café? 東京 🙂")]
STREAM_TEXTS = [
    "café naïve Zürich façade",
    "東京は日本の首都です。",
    "emoji 🙂🎉👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ½ ∞ “quotes”",
]


def chat(messages: list[tuple[str, str]]) -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages]
    )


@pytest.fixture(scope="module")
def stub(tiny_channel: grpc.Channel) -> tokenizer_pb2_grpc.TokenizerStub:
    return tokenizer_pb2_grpc.TokenizerStub(tiny_channel)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def stream_one_at_a_time(
    stub: tokenizer_pb2_grpc.TokenizerStub,
    ids: list[int],
    prompt_token_ids: list[int] | None = None,
    skip_special_tokens: bool | None = None,
) -> list[str]:
    """DetokenizeStream with one id per request message; the text deltas received."""
    requests = [tokenizer_pb2.DetokenizeStreamRequest(token_ids=[t]) for t in ids]
    requests[0].prompt_token_ids.extend(prompt_token_ids or [])
    if skip_special_tokens is not None:
        requests[0].skip_special_tokens = skip_special_tokens
    responses = stub.DetokenizeStream(iter(requests), timeout=TIMEOUT_S)
    return [r.text_delta for r in responses]


# -- results equal kvfleet.text.tokenizer -------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_tokenize_text_equals_engine_tokenizer(stub, reference, add_special_tokens):
    text = "Hello café 東京 🙂 <|im_end|> end"
    request = tokenizer_pb2.TokenizeRequest(text=text)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    response = stub.Tokenize(request, timeout=TIMEOUT_S)
    expected_flag = True if add_special_tokens is None else add_special_tokens
    # The special-token string is text (tests/tokenizer_svc/test_special_tokens.py).
    assert list(response.token_ids) == reference.encode(text, expected_flag,
                                                        split_special_tokens=True)
    assert response.prompt == text


@pytest.mark.parametrize("add_generation_prompt", [None, True, False])
def test_tokenize_chat_equals_engine_tokenizer(stub, reference, add_generation_prompt):
    request = tokenizer_pb2.TokenizeRequest(messages=chat(CHAT))
    if add_generation_prompt is not None:
        request.add_generation_prompt = add_generation_prompt
    response = stub.Tokenize(request, timeout=TIMEOUT_S)
    messages = [{"role": r, "content": c} for r, c in CHAT]
    prompt = reference.apply_chat_template(messages, add_generation_prompt is not False)
    assert response.prompt == prompt
    # Chat prompts are encoded without extra special tokens unless asked (vLLM's default).
    assert list(response.token_ids) == reference.encode(prompt, add_special_tokens=False)
    has_generation_prompt = response.prompt.endswith("<|im_start|>assistant\n")
    assert has_generation_prompt is (add_generation_prompt is not False)


@pytest.mark.parametrize("skip_special_tokens", [None, True, False])
def test_detokenize_equals_engine_tokenizer(stub, reference, skip_special_tokens):
    ids = reference.encode("<|im_start|>user\nhé 🙂<|im_end|>", False)
    request = tokenizer_pb2.DetokenizeRequest(token_ids=ids)
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    text = stub.Detokenize(request, timeout=TIMEOUT_S).text
    assert text == reference.decode(ids, skip_special_tokens is not False)


def test_get_info(stub, reference, tiny_model_dir):
    info = stub.GetInfo(tokenizer_pb2.GetInfoRequest(), timeout=TIMEOUT_S)
    assert info.model_name == tiny_model_dir.name
    assert info.vocab_size == reference.vocab_size
    assert list(info.eos_token_ids) == load_generation_eos_ids(tiny_model_dir)
    assert list(info.all_special_ids) == reference.all_special_ids
    assert info.pad_token_id == reference.pad_token_id
    assert not info.HasField("bos_token_id")  # the tiny tokenizer has no BOS token
    assert info.has_chat_template


# -- streaming detokenization -------------------------------------------------------------


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_one_token_at_a_time(stub, reference, text):
    ids = reference.encode(text, False)
    deltas = stream_one_at_a_time(stub, ids)
    # Lockstep: one response per request; a flush response only if text was held back.
    assert len(deltas) in (len(ids), len(ids) + 1)
    assert "".join(deltas) == reference.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "" in deltas  # multi-byte characters span tokens in the tiny vocabulary


def test_stream_with_prompt_context_and_special_tokens(stub, reference):
    prompt_ids = reference.encode("<|im_start|>assistant\n", False)
    ids = reference.encode("Voilà 🙂<|im_end|>", False)
    deltas = stream_one_at_a_time(stub, ids, prompt_token_ids=prompt_ids, skip_special_tokens=False)
    assert "".join(deltas) == "Voilà 🙂<|im_end|>"


def test_stream_is_lockstep(stub, reference):
    """Each request message gets its response before the next is sent (no buffering)."""
    ids = reference.encode("naïve 東京", False)
    outbox: queue.Queue[tokenizer_pb2.DetokenizeStreamRequest | None] = queue.Queue()

    def requests() -> Iterator[tokenizer_pb2.DetokenizeStreamRequest]:
        while (item := outbox.get(timeout=TIMEOUT_S)) is not None:
            yield item

    responses = stub.DetokenizeStream(requests(), timeout=TIMEOUT_S)
    deltas = []
    for token_id in ids:
        outbox.put(tokenizer_pb2.DetokenizeStreamRequest(token_ids=[token_id]))
        deltas.append(next(responses).text_delta)
    outbox.put(None)
    deltas.extend(r.text_delta for r in responses)
    assert "".join(deltas) == "naïve 東京"


# -- health and reflection ----------------------------------------------------------------


@pytest.mark.parametrize("service", ["", "kvfleet.v1.Tokenizer"])
def test_health_reports_serving(tiny_channel, service):
    health = health_pb2_grpc.HealthStub(tiny_channel)
    response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_health_unknown_service_is_not_found(tiny_channel):
    health = health_pb2_grpc.HealthStub(tiny_channel)
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="nope.Svc"), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_services(tiny_channel):
    database = ProtoReflectionDescriptorDatabase(tiny_channel)
    assert set(database.get_services()) == {
        "kvfleet.v1.Tokenizer",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    # A client with no stubs (grpcurl-style) can resolve the full schema through reflection.
    pool = descriptor_pool.DescriptorPool(database)
    service = pool.FindServiceByName("kvfleet.v1.Tokenizer")
    assert [m.name for m in service.methods] == [
        "Tokenize",
        "Detokenize",
        "DetokenizeStream",
        "GetInfo",
    ]
    request = pool.FindMessageTypeByName("kvfleet.v1.TokenizeRequest")
    assert request.fields_by_name["messages"].message_type.full_name == "kvfleet.v1.ChatMessages"


# -- bad input ----------------------------------------------------------------------------

BAD_TOKENIZE = [
    pytest.param(tokenizer_pb2.TokenizeRequest(), "input must be set", id="no-input"),
    pytest.param(tokenizer_pb2.TokenizeRequest(text=""), "text must not be empty", id="empty"),
    pytest.param(
        tokenizer_pb2.TokenizeRequest(messages=chat([])), "messages must not be empty", id="none"
    ),
    pytest.param(
        tokenizer_pb2.TokenizeRequest(messages=chat([("user", "hi"), ("robot", "beep")])),
        "messages[1].role must be one of",
        id="bad-role",
    ),
    pytest.param(
        tokenizer_pb2.TokenizeRequest(messages=chat([("", "hi")])),
        "messages[0].role",
        id="empty-role",
    ),
]


@pytest.mark.parametrize(("request_message", "message"), BAD_TOKENIZE)
def test_tokenize_bad_input_is_invalid_argument(stub, request_message, message):
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(request_message, timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    # The server keeps serving after a bad request.
    assert stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="ok"), timeout=TIMEOUT_S).token_ids


def test_detokenize_out_of_vocabulary_is_invalid_argument(stub, reference):
    bad = reference.vocab_size
    with pytest.raises(grpc.RpcError) as info:
        stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=[5, bad]), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        f"token_ids[1] = {bad} is outside the vocabulary (size {reference.vocab_size})"
    )
    assert stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=[5]), timeout=TIMEOUT_S)


def test_stream_error_mid_stream_is_invalid_argument(stub, reference):
    ids = reference.encode("hello world", False)
    requests = [
        tokenizer_pb2.DetokenizeStreamRequest(token_ids=ids[:2]),
        tokenizer_pb2.DetokenizeStreamRequest(token_ids=[reference.vocab_size + 7]),
        tokenizer_pb2.DetokenizeStreamRequest(token_ids=ids[2:]),
    ]
    responses = stub.DetokenizeStream(iter(requests), timeout=TIMEOUT_S)
    first = next(responses)  # the good prefix was answered before the error
    assert first.text_delta == reference.decode(ids[:2])
    with pytest.raises(grpc.RpcError) as info:
        next(responses)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids[0]" in info.value.details()
    assert "".join(stream_one_at_a_time(stub, ids)) == "hello world"


def test_stream_options_only_on_first_message(stub):
    requests = [
        tokenizer_pb2.DetokenizeStreamRequest(token_ids=[5]),
        tokenizer_pb2.DetokenizeStreamRequest(token_ids=[6], skip_special_tokens=False),
    ]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.DetokenizeStream(iter(requests), timeout=TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first message" in info.value.details()


STRICT_TEMPLATE = (
    "{% if messages[0]['role'] != 'user' %}"
    "{{ raise_exception('Conversation must start with a user message') }}{% endif %}"
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        pytest.param(
            STRICT_TEMPLATE,
            "the chat template rejected the messages: Conversation must start with a user",
            id="template-raises",
        ),
        pytest.param(None, "this tokenizer has no chat template", id="no-template"),
    ],
)
def test_chat_template_refusals_are_invalid_argument(
    threaded_server, tiny_model_dir, tmp_path, template, message
):
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    server = threaded_server(lambda: build_server(tmp_path, "127.0.0.1", 0))
    with grpc.insecure_channel(server.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        assert stub.GetInfo(tokenizer_pb2.GetInfoRequest()).has_chat_template is bool(template)
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(tokenizer_pb2.TokenizeRequest(messages=chat(CHAT)), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


# -- SmolLM2 (slow tier) ------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_tokenize_detokenize_and_stream(smollm2_channel, smollm2_dir):
    stub = tokenizer_pb2_grpc.TokenizerStub(smollm2_channel)
    reference = Tokenizer.from_dir(smollm2_dir)
    text = "The café in 東京 serves crème brûlée 🙂🎉"
    response = stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text), timeout=TIMEOUT_S)
    assert list(response.token_ids) == reference.encode(text)
    chat_request = tokenizer_pb2.TokenizeRequest(messages=chat(CHAT))
    chat_response = stub.Tokenize(chat_request, timeout=TIMEOUT_S)
    messages = [{"role": r, "content": c} for r, c in CHAT]
    assert chat_response.prompt == reference.apply_chat_template(messages, True)
    assert list(chat_response.token_ids) == reference.encode(chat_response.prompt, False)
    ids = list(response.token_ids)
    detok = stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=ids), timeout=TIMEOUT_S)
    assert detok.text == reference.decode(ids)
    for sample in STREAM_TEXTS:
        sample_ids = reference.encode(sample, False)
        deltas = stream_one_at_a_time(stub, sample_ids)
        assert "".join(deltas) == reference.decode(sample_ids) == sample
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
