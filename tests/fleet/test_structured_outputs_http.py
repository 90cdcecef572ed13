"""Structured outputs through a real fleet: the official `openai` SDK over HTTP, and gRPC.

One engine on the tiny model, whose text is gibberish: whatever shape the output has comes
from the constraint. A bad schema, regex or grammar is refused by the router with HTTP 400
(or INVALID_ARGUMENT) naming the exact field, before any engine work.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.contracts.structured_outputs import StructuredOutputsParams
from kvfleet.contracts.structured_proto import to_proto
from kvfleet.fleet import Fleet
from kvfleet.router_client import build_request
from kvfleet.v1 import common_pb2
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import API_KEYS, RouterClient

pytestmark = pytest.mark.timeout(240)

MESSAGES = [{"role": "user", "content": "Describe the weather as JSON."}]
WEATHER = {
    "type": "object",
    "properties": {
        "sky": {"enum": ["clear", "cloudy", "rain"]},
        "windy": {"type": "boolean"},
        "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
    },
    "required": ["sky", "windy", "celsius"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {"num_engines": 1, "api_keys": True, "metrics": True}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> str:
    return tiny_model_dir.name


def test_response_format_json_schema_returns_valid_json(openai_client: OpenAI, model: str):
    reply = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=64, temperature=0, response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
        },
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), WEATHER)


def test_response_format_json_object_streams_an_object(openai_client: OpenAI, model: str):
    stream = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=48, temperature=0, stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("extra_body", "pattern"),
    [
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, r"alpha|beta"),
        ({"guided_regex": r"[0-9]{3}-[0-9]{2}"}, r"[0-9]{3}-[0-9]{2}"),
        ({"structured_outputs": {"grammar": 'root ::= "go" ("!" | "?")'}}, r"go[!?]"),
    ],
)
def test_vllm_extra_body_constraints(openai_client: OpenAI, model: str, extra_body, pattern):
    reply = openai_client.completions.create(
        model=model, prompt="Pick:", max_tokens=16, temperature=0, extra_body=extra_body
    )
    assert re.fullmatch(pattern, reply.choices[0].text)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "w", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}},
         "structured_outputs.regex"),
        ({"extra_body": {"guided_grammar": "start: missing_rule"}}, "guided_grammar"),
        ({"extra_body": {"guided_choice": [], }}, "guided_choice"),
        ({"response_format": {"type": "json_object"},
          "extra_body": {"guided_regex": "a"}}, "guided_regex"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    openai_client: OpenAI, model: str, kwargs, param: str
):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, **kwargs
        )
    assert info.value.param == param, info.value.message


def test_grpc_carries_the_constraint(client: RouterClient):
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=16)
    params.structured_outputs.CopyFrom(to_proto(StructuredOutputsParams(choice=["up", "down"])))
    completion = client.generate(build_request("Which way?", params=params),
                                 API_KEYS["tenant-0"])
    assert completion.finish_reason == "stop" and completion.text in ("up", "down")
    params.structured_outputs.CopyFrom(to_proto(StructuredOutputsParams(regex="(")))
    with pytest.raises(grpc.RpcError) as info:
        client.generate(build_request("Which way?", params=params), API_KEYS["tenant-0"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in (info.value.details() or "")


def test_engine_metrics_count_constrained_requests_and_compiles(
    fleet: Fleet, openai_client: OpenAI, model: str
):
    for schema in ({"type": "boolean"}, {"enum": [1, 2]}):
        openai_client.completions.create(model=model, prompt="x", max_tokens=8,
                                         extra_body={"guided_json": schema})
    url = f"http://127.0.0.1:{fleet.engines[0].metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    assert values["kvfleet:structured_output_requests_total"] >= 2
    assert values["kvfleet:structured_output_compile_seconds_count"] >= 2
    assert values["kvfleet:structured_output_mask_seconds_count"] > 0


def engine_counters(fleet: Fleet) -> dict[str, float]:
    url = f"http://127.0.0.1:{fleet.engines[0].metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_bad_constraints_and_tools_never_reach_the_engine(
    fleet: Fleet, openai_client: OpenAI, model: str
):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad_tool = {"type": "function", "function": {"name": "g", "parameters": {"type": 5}}}
    cases = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "w", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"tools": [tool, {**tool, "function": {**tool["function"], "name": "h"}}, bad_tool]},
         "tools[2].function.parameters"),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
    ]
    watched = ("kvfleet:structured_output_compile_seconds_count",
               "kvfleet:structured_output_requests_total", "kvfleet:prompt_tokens_total")
    # One good constrained request first, so every watched series exists and has moved.
    openai_client.completions.create(model=model, prompt="x", max_tokens=2,
                                     extra_body={"guided_json": {"type": "boolean"}})
    before = engine_counters(fleet)
    assert all(before.get(k, 0.0) > 0 for k in watched), before
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            openai_client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=4, **kwargs)
        assert info.value.param == param, info.value.message
    after = engine_counters(fleet)
    assert {k: after.get(k, 0.0) for k in watched} == {k: before.get(k, 0.0) for k in watched}
