"""Chat `tools` / `tool_choice`: validation naming the exact field, the forced-choice JSON
schema, tool turns in the router request, and the router-flag check for `auto`."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from kvfleet.contracts.errors import InvalidFieldError
from router.openai.chat_output import ChatOutputConfig, plan_chat_output
from router.openai.requests import ChatCompletionRequest, parse_body
from router.openai.tools import ToolChoice, check_tools, tool_choice_schema
from router.request_limits import RequestLimits

USER = [{"role": "user", "content": "hi"}]


def tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]})
TIME = tool("get_time")


def refused(body: dict[str, Any]) -> InvalidFieldError:
    with pytest.raises(InvalidFieldError) as info:
        parse_body(ChatCompletionRequest, {"messages": USER, **body},
                   RequestLimits()).to_router_requests()
    return info.value


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"tools": [WEATHER, TIME, tool("bad", {"type": 5})]}, "tools[2].function.parameters",
         "not a valid JSON schema"),
        ({"tools": [tool("bad", ["not", "an", "object"])]}, "tools[0].function.parameters",
         "JSON schema object"),
        ({"tools": [WEATHER, {"type": "retrieval"}]}, "tools[1].type", '"function"'),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]},
         "tools[0].function.name", "non-empty string"),
        ({"tools": [WEATHER, TIME, WEATHER]}, "tools[2].function.name", "unique"),
        ({"tools": {"a": 1}}, "tools", "array"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "does not match any of the specified `tools`"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
         "tool_choice.function.name", "non-empty string"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
         "`tools` must be set"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", '"required"'),
        ({"messages": [{"role": "tool", "content": "12 C"}]}, "messages[0].tool_call_id",
         "tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]},
         "messages[0].tool_calls[0].function", "string name"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, USER[0]]},
         None, None),
    ],
)
def test_bad_tool_fields_are_400_naming_the_exact_field(
    body: dict[str, Any], param: str | None, needle: str | None
) -> None:
    if param is None:  # an empty tool_calls list is no calls
        parse_body(ChatCompletionRequest, body, RequestLimits()).to_router_requests()
        return
    error = refused(body)
    assert error.param == param and needle in str(error), error


def test_defaults_follow_openai() -> None:
    assert check_tools(None, None) == ToolChoice("none")
    assert check_tools([WEATHER], None) == ToolChoice("auto")
    assert check_tools([], "none") == ToolChoice("none")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert check_tools([WEATHER, TIME], named) == ToolChoice("named", "get_time")


def test_named_schema_is_the_function_parameters() -> None:
    choice = ToolChoice("named", "get_weather")
    assert tool_choice_schema([WEATHER, TIME], choice, True) == WEATHER["function"]["parameters"]
    empty = tool_choice_schema([WEATHER, TIME], ToolChoice("named", "get_time"), True)
    assert empty == {"type": "object", "properties": {}}
    assert tool_choice_schema([WEATHER], ToolChoice("auto"), True) is None
    assert tool_choice_schema([WEATHER], ToolChoice("none"), True) is None


def test_required_schema_accepts_calls_of_the_tools_only() -> None:
    schema = tool_choice_schema([WEATHER, TIME], ToolChoice("required"), True)
    assert schema is not None
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}},
          {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "other", "parameters": {}}], {"name": "get_time"},
                [{"name": "get_time", "parameters": {}, "note": "extra keys are refused"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema([WEATHER, TIME], ToolChoice("required"), False)
    assert single is not None and single["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)


def test_tool_turns_and_tools_reach_the_router_request() -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]
    body = parse_body(ChatCompletionRequest, {"messages": messages, "tools": [WEATHER],
                                              "tool_choice": "none"}, RequestLimits())
    (request,) = body.to_router_requests()
    assistant, answer = request.messages.messages[1], request.messages.messages[2]
    assert assistant.content == "" and assistant.tool_calls[0].name == "get_weather"
    assert assistant.tool_calls[0].arguments == '{"city": "Paris"}'
    assert assistant.tool_calls[0].id == "call_1"
    assert (answer.role, answer.tool_call_id, answer.content) == ("tool", "call_1", "12 C")
    assert '"get_weather"' in request.messages.tools_json


def plan(body: dict[str, Any], config: ChatOutputConfig) -> Any:
    parsed = parse_body(ChatCompletionRequest, {"messages": USER, **body}, RequestLimits())
    requests = parsed.to_router_requests()
    return plan_chat_output(parsed.tools, parsed.checked_tool_choice(),
                            parsed.parallel_tool_calls is not False, config, requests)


def test_auto_needs_the_router_flags_and_none_needs_no_plan() -> None:
    with pytest.raises(InvalidFieldError) as info:
        plan({"tools": [WEATHER]}, ChatOutputConfig())
    assert info.value.param == "tool_choice"
    assert str(info.value) == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    hermes = ChatOutputConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert plan({"tools": [WEATHER]}, hermes).tool_call_parser == "hermes"
    assert plan({"tools": [WEATHER], "tool_choice": "none"}, ChatOutputConfig()) is None
    assert plan({}, ChatOutputConfig()) is None
    required = plan({"tools": [WEATHER], "tool_choice": "required"}, ChatOutputConfig())
    assert required.tool_choice.mode == "required"


def test_hermes_keeps_special_tokens_in_the_text() -> None:
    hermes = ChatOutputConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    for choice, skip in (("auto", False), ("none", True)):
        parsed = parse_body(ChatCompletionRequest, {"messages": USER, "tools": [WEATHER],
                                                    "tool_choice": choice}, RequestLimits())
        (request,) = parsed.to_router_requests()
        plan_chat_output(parsed.tools, parsed.checked_tool_choice(), True, hermes, [request])
        assert request.sampling_params.skip_special_tokens is skip


@pytest.mark.parametrize(("parser", "start"), [("deepseek_r1", None), ("qwen3", "<think>")])
def test_a_reasoning_parser_starts_the_grammar_after_the_reasoning(parser, start) -> None:
    config = ChatOutputConfig(reasoning_parser=parser)
    for body in ({"tools": [WEATHER], "tool_choice": "required"},
                 {"response_format": {"type": "json_object"}}):
        parsed = parse_body(ChatCompletionRequest, {"messages": USER, **body}, RequestLimits())
        (request,) = parsed.to_router_requests()
        plan_chat_output(parsed.tools, parsed.checked_tool_choice(), True, config, [request])
        constraint = request.sampling_params.structured_outputs
        assert constraint.reasoning_end == "</think>"
        assert (constraint.reasoning_start if constraint.HasField("reasoning_start")
                else None) == start
    # Without a reasoning parser the grammar holds from the first token.
    parsed = parse_body(ChatCompletionRequest, {"messages": USER, "response_format": {
        "type": "json_object"}}, RequestLimits())
    (request,) = parsed.to_router_requests()
    plan_chat_output(None, parsed.checked_tool_choice(), True, ChatOutputConfig(), [request])
    assert not request.sampling_params.structured_outputs.HasField("reasoning_end")
