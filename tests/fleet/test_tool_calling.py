"""Tool calling and reasoning through a real fleet with the official OpenAI SDK: the router
started with `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`,
the tokenizer with a tool-aware template (the tiny model's own ignores tools).

The tiny model writes random text, so what is checked is what stays deterministic:
validation errors naming their field, tool turns rendered by the template (/tokenize), and
greedy outputs whose streamed deltas, accumulated as the SDK does, equal the whole response.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

from kvfleet.fleet import Fleet
from tests.fixtures.fleets import OPENAI_KEY, FleetOptions
from tests.fixtures.tool_template import TOOL_TEMPLATE

pytestmark = pytest.mark.timeout(240)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TURNS = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C and rain"},
]


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 1,
        "api_keys": True,
        "engine_args": ("--num-kv-blocks", "64", "--max-model-len", "512"),
        "engine_threads": 1,
        "chat_template": TOOL_TEMPLATE,
        "router_args": ("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3"),
    }


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> str:
    return tiny_model_dir.name


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [WEATHER, {"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "required": "city"}}}]},
         "tools[1].function.parameters"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400_naming_the_field(
    openai_client: OpenAI, model: str, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=model, messages=USER, max_tokens=2, **kwargs)
    assert info.value.param == param, info.value.message


def post(fleet: Fleet, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        fleet.http_url + path, data=json.dumps(body).encode(), method="POST",
        headers={"authorization": f"Bearer {OPENAI_KEY}", "content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_tool_turns_are_rendered_by_the_template(fleet: Fleet, model: str) -> None:
    tokens = post(fleet, "/tokenize", {"model": model, "messages": TURNS, "tools": [WEATHER]})
    prompt = post(fleet, "/detokenize", {"model": model, "tokens": tokens["tokens"]})["prompt"]
    assert '<tools>{"name": "get_weather"' in prompt
    assert '"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<tool_response id=call_1>12 C and rain</tool_response>" in prompt


def accumulate(stream: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or ():
                entry = out["calls"].setdefault(call.index, ["", ""])
                if call.function and call.function.name:
                    entry[0] = call.function.name
                entry[1] += (call.function.arguments or "") if call.function else ""
            out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = list(out["calls"].values())
    return out


def whole(response: Any) -> dict[str, Any]:
    (choice,) = response.choices
    message = choice.message
    return {
        "content": message.content or "",
        "reasoning": (message.model_extra or {}).get("reasoning_content") or "",
        "calls": [[c.function.name, c.function.arguments] for c in message.tool_calls or ()],
        "finish": choice.finish_reason,
    }


@pytest.mark.parametrize(
    "tool_choice",
    ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}],
)
def test_greedy_streamed_deltas_equal_the_whole_response(
    openai_client: OpenAI, model: str, tool_choice: Any
) -> None:
    kwargs: dict[str, Any] = {"model": model, "messages": TURNS, "tools": [WEATHER],
                              "tool_choice": tool_choice, "max_tokens": 12, "temperature": 0}
    response = openai_client.chat.completions.create(**kwargs)
    expected = whole(response)
    assert accumulate(openai_client.chat.completions.create(stream=True, **kwargs)) == expected
    message = response.choices[0].message
    if isinstance(tool_choice, dict):  # the output is the call's arguments (grammar-held)
        (call,) = message.tool_calls or ()
        assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        assert message.content is None and response.choices[0].finish_reason != "tool_calls"
    elif tool_choice == "none":
        assert not message.tool_calls
    elif tool_choice == "required" and not message.tool_calls:  # not a JSON array of calls
        assert message.content


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choices_are_held_to_their_schema(
    openai_client: OpenAI, model: str, tool_choice: Any
) -> None:
    # The grammar (structured outputs) holds a forced choice's output to vLLM's schema. The
    # tiny model's gibberish rarely closes it within max_tokens, but what it writes is the
    # schema's start: an array of calls (required) or the tool's arguments object (named).
    response = openai_client.chat.completions.create(
        model=model, messages=USER, tools=[WEATHER], tool_choice=tool_choice, max_tokens=24,
        temperature=0,
    )
    message = response.choices[0].message
    if tool_choice == "required":
        text = message.content or ""
        assert re.match(r'\[\s*\{\s*"name"', text) or message.tool_calls, message
    else:
        (call,) = message.tool_calls or ()
        assert re.match(r'\{\s*"city"', call.function.arguments), call


UNIT = {"type": "function", "function": {
    "name": "set_unit", "description": "Temperature unit",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                  "on": {"type": "boolean"}},
                   "required": ["unit", "on"]}}}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "set_unit"}}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_finish_parse_and_validate(
    openai_client: OpenAI, model: str, tool_choice: Any, stream: bool
) -> None:
    # A tool whose arguments close within a few tokens whatever the model writes (enum and
    # boolean, no free text), so the whole call is there to check, streamed and not.
    # Required with UNIT alone: a shorter prompt leaves room in the 512-token context for
    # the free whitespace the tiny model writes between the tokens the grammar fixes.
    tools = [UNIT] if tool_choice == "required" else [WEATHER, UNIT]
    kwargs: dict[str, Any] = {"model": model, "messages": USER, "tools": tools,
                              "tool_choice": tool_choice, "temperature": 0,
                              "max_tokens": 220 if tool_choice == "required" else 140}
    if stream:
        result = accumulate(openai_client.chat.completions.create(stream=True, **kwargs))
    else:
        result = whole(openai_client.chat.completions.create(**kwargs))
    assert result["finish"] == ("tool_calls" if tool_choice == "required" else "stop"), result
    assert result["calls"] and not result["content"], result
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, arguments in result["calls"]:
        assert name in schemas and (tool_choice == "required" or name == "set_unit"), result
        jsonschema.Draft202012Validator(schemas[name]).validate(json.loads(arguments))


def test_a_forced_tool_choice_and_response_format_are_refused_together(
    openai_client: OpenAI, model: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=model, messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=4,
            response_format={"type": "json_object"},
        )
    assert info.value.param == "tool_choice"
