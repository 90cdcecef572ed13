"""OpenAI / vLLM structured-output body fields -> the proto constraint, and their 400s.

No fleet: bodies are parsed with router.openai.requests and the router's own request check
(router.pipeline.validate_request), which compiles the grammar with llguidance.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.contracts.sampling_proto import to_sampling_params
from kvfleet.contracts.structured_outputs import StructuredOutputsParams
from kvfleet.contracts.structured_proto import from_proto, to_proto
from kvfleet.router_client import build_request
from kvfleet.v1 import common_pb2
from router.engine_requests import validate_request
from router.openai.requests import ChatCompletionRequest, CompletionRequest, parse_body
from router.request_limits import RequestLimits

SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "x"}], **fields}


def constraint(body: dict[str, Any]) -> StructuredOutputsParams | None:
    cls = ChatCompletionRequest if "messages" in body else CompletionRequest
    (request,) = parse_body(cls, body, RequestLimits()).to_router_requests()
    return validate_request(request).structured_outputs


def refused(body: dict[str, Any]) -> InvalidFieldError:
    with pytest.raises(InvalidFieldError) as info:
        constraint(body)
    return info.value


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (chat(response_format={"type": "json_schema",
                               "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}),
         StructuredOutputsParams(json=json.dumps(SCHEMA))),
        (chat(response_format={"type": "json_object"}), StructuredOutputsParams(json_object=True)),
        (chat(structured_outputs={"regex": "a+", "json_object": False}),
         StructuredOutputsParams(regex="a+")),
        ({"prompt": "x", "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)),
        ({"prompt": "x", "guided_json": SCHEMA}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"prompt": "x", "guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        ({"prompt": "x", "guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ({"prompt": "x", "guided_grammar": 'root ::= "x"'},
         StructuredOutputsParams(grammar='root ::= "x"')),
        (chat(response_format={"type": "text"}), None),
        (chat(), None),
        (chat(guided_regex="a", guided_decoding_backend="guidance"),
         StructuredOutputsParams(regex="a")),
    ],
)
def test_each_source_becomes_the_same_constraint(body, expected):
    got = constraint(body)
    assert (got and got.key) == (expected and expected.key)


def test_schema_key_order_survives_the_proto():
    (request,) = parse_body(ChatCompletionRequest, chat(guided_json=SCHEMA),
                            RequestLimits()).to_router_requests()
    schema = json.loads(request.sampling_params.structured_outputs.json)
    assert list(schema["properties"]) == ["b", "a"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(response_format={"type": "json_schema",
                               "json_schema": {"name": "s", "schema": {"type": "nope"}}}),
         "response_format.json_schema.schema"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "s"}}),
         "response_format.json_schema.schema"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "s",
                                                                      "schema": [1]}}),
         "response_format.json_schema.schema"),
        (chat(response_format={"type": "xml"}), "response_format.type"),
        (chat(response_format="json"), "response_format"),
        (chat(structured_outputs={"regex": "("}), "structured_outputs.regex"),
        (chat(structured_outputs={"grammar": "start: nope"}), "structured_outputs.grammar"),
        (chat(structured_outputs={"json": "{"}), "structured_outputs.json"),
        (chat(structured_outputs={"choice": ["a", 1]}), "structured_outputs.choice"),
        (chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
        (chat(structured_outputs={"structural_tag": "x"}), "structured_outputs.structural_tag"),
        (chat(structured_outputs="a+"), "structured_outputs"),
        (chat(guided_regex="("), "guided_regex"),
        (chat(guided_json={"type": "object", "properties": 3}), "guided_json"),
        (chat(guided_choice="a"), "guided_choice"),
        (chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
         "structured_outputs"),
    ],
)
def test_bad_constraints_name_the_exact_field(body, param):
    error = refused(body)
    assert error.param == param, str(error)


def test_a_grpc_request_with_a_bad_grammar_is_refused_by_the_router_check():
    params = common_pb2.SamplingParams()
    params.structured_outputs.CopyFrom(to_proto(StructuredOutputsParams(regex="a")))
    params.structured_outputs.grammar = "start: nope"  # two constraints set
    with pytest.raises(InvalidFieldError) as info:
        to_sampling_params(params)
    assert info.value.param == "structured_outputs"
    params.structured_outputs.ClearField("regex")
    with pytest.raises(InvalidFieldError) as info:
        validate_request(build_request("x", params=params))
    assert info.value.param == "structured_outputs.grammar"


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex="a|b"),
        StructuredOutputsParams(choice=["x"]),
        StructuredOutputsParams(grammar='start: "a"'),
    ],
)
def test_proto_round_trip_keeps_every_kind(params):
    assert from_proto(to_proto(params)).key == params.key


def test_sampling_params_take_the_constraint_as_a_dict():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(structured_outputs={"regex": "a", "grammar": "start: \"a\""})
    assert info.value.param == "structured_outputs"
