"""OpenAI `tools` / `tool_choice` / `parallel_tool_calls`: validation, and the JSON schema a
forced tool choice holds the output to.

Role: pure functions over the decoded body fields, no I/O. `check_tools` runs when the
body is parsed, before any engine work, and raises `InvalidFieldError` naming the exact
field (`tools[2].function.parameters`, `tool_choice.function.name`, ...).
`tool_choice_schema` is vLLM's schema for `required` and named choices;
`constrain_to_schema` is the one place that hands it to the grammar engine.

Invariants:
- A tool is `{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}`; `parameters` must be a JSON schema object valid under its meta-schema
  (Draft 2020-12 unless it names another `$schema`). Names are unique.
- `tool_choice` defaults to "auto" when tools are given and "none" otherwise (OpenAI's and
  vLLM's defaults); any other choice than "none" needs tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
from jsonschema.exceptions import SchemaError

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.structured_grammar import check_compiles
from kvfleet.contracts.structured_outputs import StructuredOutputsParams
from kvfleet.contracts.structured_proto import to_proto as structured_to_proto
from kvfleet.v1 import common_pb2

ToolMode = Literal["none", "auto", "required", "named"]
_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolMode
    # The forced function, for mode "named".
    name: str | None = None


def check_tools(tools: Any, tool_choice: Any) -> ToolChoice:
    """The request's tool choice; InvalidFieldError naming the first bad field."""
    if tools is not None:
        _check_tool_list(tools)
    names = [tool["function"]["name"] for tool in tools or ()]
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in _MODES:
            raise InvalidFieldError("tool_choice", _CHOICE_FORMS)
        choice = ToolChoice(tool_choice)  # type: ignore[arg-type]
    else:
        choice = ToolChoice("named", _named_choice(tool_choice))
    if choice.mode != "none" and not names:
        raise InvalidFieldError("tool_choice", "When using `tool_choice`, `tools` must be set.")
    if choice.name is not None and choice.name not in names:
        raise InvalidFieldError(
            "tool_choice.function.name",
            f"The tool specified in `tool_choice` ({choice.name!r}) does not match any of the "
            "specified `tools`",
        )
    return choice


def tool_choice_schema(
    tools: list[dict[str, Any]] | None, tool_choice: ToolChoice, parallel_tool_calls: bool
) -> dict[str, Any] | None:
    """The JSON schema the output must follow for a forced choice (None: free text).

    Named: that function's parameters. Required: an array of `{"name", "parameters"}`
    objects (no other keys), one alternative per tool (`anyOf`), at least one call, at most
    one unless parallel calls are allowed (vLLM's shape, closed to extra keys)."""
    if tool_choice.mode == "named":
        function = next(t["function"] for t in tools or () if t["function"]["name"]
                        == tool_choice.name)
        return _parameters(function)
    if tool_choice.mode != "required":
        return None
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _parameters(t["function"]),
                },
                "required": ["name", "parameters"],
                # Unlike vLLM's schema: a call holds these two keys only, so a weak model
                # cannot ramble on in extra keys and never close the array (the parser
                # would drop them anyway).
                "additionalProperties": False,
            }
            for t in tools or ()
        ]},
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def constrain_to_schema(params: common_pb2.SamplingParams, schema: dict[str, Any]) -> None:
    """Hold the request's output to `schema` (forced tool choices): the sampling params'
    `structured_outputs.json`, as vLLM's `structured_outputs={"json": schema}`.

    A request that already asks for structured outputs (`response_format`, ...) cannot also
    force a tool: both would constrain the same output. A schema the grammar engine cannot
    enforce (e.g. a `not` in some tool's parameters) is the `tools` field's fault."""
    if params.HasField("structured_outputs"):
        raise InvalidFieldError(
            "tool_choice",
            "a required or named tool_choice cannot be combined with response_format or "
            "structured outputs (both constrain the output)",
        )
    constraint = StructuredOutputsParams(json=schema)
    check_compiles(constraint, "tools")
    params.structured_outputs.CopyFrom(structured_to_proto(constraint))


def tools_json(tools: list[dict[str, Any]] | None) -> str:
    """`tools` as the proto's ChatMessages.tools_json (empty: none). ASCII: JSON escapes
    carry any string, even an unpaired surrogate, which UTF-8 could not."""
    return json.dumps(tools) if tools else ""


_CHOICE_FORMS = (
    '`tool_choice` must either be a named tool, "auto", "required", or "none".'
)


def _named_choice(choice: Any) -> str:
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise InvalidFieldError("tool_choice", _CHOICE_FORMS)
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidFieldError("tool_choice.function.name",
                                "tool_choice.function.name must be a non-empty string")
    return name


def _check_tool_list(tools: Any) -> None:
    if not isinstance(tools, list):
        raise InvalidFieldError("tools", "tools must be an array of tools")
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{index}]")
        if name in seen:
            raise InvalidFieldError(
                f"tools[{index}].function.name",
                f"tools[{index}] and tools[{seen[name]}] are both named {name!r}; tool names "
                "must be unique",
            )
        seen[name] = index


def _check_tool(tool: Any, param: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidFieldError(f"{param}.type", f'{param}.type must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidFieldError(f"{param}.function", f"{param}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidFieldError(f"{param}.function.name",
                                f"{param}.function.name must be a non-empty string")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidFieldError(f"{param}.function.description",
                                f"{param}.function.description must be a string")
    if "parameters" in function:
        _check_schema(function["parameters"], f"{param}.function.parameters")
    return name


def _check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise InvalidFieldError(param, f"{param} must be a JSON schema object")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise InvalidFieldError(
            param, f"{param} is not a valid JSON schema: {e.message}"
            + (f" (at {where})" if where else ""),
        ) from None


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    # A function without parameters takes an empty object, as OpenAI treats it.
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}


def message_tool_calls(calls: Any, message_index: int) -> list[common_pb2.ToolCall]:
    """An assistant message's `tool_calls` as proto calls; InvalidFieldError naming the field.
    Arguments given as an object (not OpenAI's JSON string) are serialized."""
    param = f"messages[{message_index}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidFieldError(param, f"{param} must be an array")
    out = []
    for index, call in enumerate(calls):
        where = f"{param}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidFieldError(f"{where}.function",
                                    f"{where}.function must be an object with a string name")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise InvalidFieldError(f"{where}.id", f"{where}.id must be a string")
        _check_unicode(f"{where}.function", function["name"] + arguments + call_id)
        out.append(common_pb2.ToolCall(id=call_id, name=function["name"], arguments=arguments))
    return out


def _check_unicode(param: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON escapes can carry unpaired surrogates
        raise InvalidFieldError(param, f"{param} is not valid Unicode") from None
