"""Tool-call parsers (hermes, forced required / named): what they extract, and that every
split of an output into pieces streams the same content and calls as the whole output."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import pytest

from router.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    new_tool_parser,
    tool_parser_names,
)
from tests.unit.stream_splits import splits

Result = tuple[str, list[tuple[str, str]]]


def run(make: Callable[[], ToolParser], pieces: Iterable[str]) -> Result:
    """Content and (name, arguments) per call, accumulated as the OpenAI SDK does."""
    parser = make()
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index not in calls and call.name is not None
                assert call.index == len(calls)
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return content, [(name, args) for name, args in calls.values()]


def hermes() -> ToolParser:
    return new_tool_parser("hermes")


CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": 2}]}}'
        "\n</tool_call>")
HERMES_CASES: list[tuple[str, Result]] = [
    ("Just text, no call.  ", ("Just text, no call.  ", [])),
    ("", ("", [])),
    ("a < b <tool and <tool_call", ("a < b <tool and <tool_call", [])),
    (CALL, ("", [("get_weather", '{"city": "Paris", "n": [1, {"a": 2}]}')])),
    ("Let me check.\n" + CALL + "\n" + CALL + "\n",
     ("Let me check.", [("get_weather", '{"city": "Paris", "n": [1, {"a": 2}]}')] * 2)),
    # Arguments before the name: judged whole, re-serialized.
    ('<tool_call>{"arguments": {"x": "}"}, "name": "f"}</tool_call>', ("", [("f", '{"x": "}"}')])),
    # Not a call: back into the content verbatim.
    ("x <tool_call>not json</tool_call> y", ("x <tool_call>not json</tool_call> y", [])),
    # Cut off by max_tokens: the name is known, the arguments keep what was generated.
    ('<tool_call>{"name": "f", "arguments": {"q": "ab', ("", [("f", '{"q": "ab')])),
    ('<tool_call>{"name": "f", "arguments": {"q": "}"', ("", [("f", '{"q": "')])),
    ('<tool_call>{"name": "a\\"b", "arguments": {}}</tool_call>', ("", [('a"b', "{}")])),
    ("<tool_call>{\"name\": \"f\",\n \"arguments\":  {\"k\": \"é\"}  }  </tool_call> done",
     (" done", [("f", '{"k": "é"}')])),
]


@pytest.mark.parametrize("output,expected", HERMES_CASES)
def test_hermes_extracts_calls_and_content(output: str, expected: Result) -> None:
    assert run(hermes, [output]) == expected


@pytest.mark.parametrize("output,expected", HERMES_CASES)
def test_hermes_streams_the_same_result_for_every_split(output: str, expected: Result) -> None:
    for pieces in splits(output):
        assert run(hermes, pieces) == expected, pieces


def test_hermes_never_leaks_a_partial_marker_and_streams_arguments_early() -> None:
    parser = hermes()
    assert parser.feed("Hi <tool").content == "Hi"
    assert parser.feed("_ca").content == ""
    first = parser.feed('ll>{"name": "f", "arguments": {"a": "long')
    assert first.content == "" and first.tool_calls[0].name == "f"
    assert (first.tool_calls[0].id or "").startswith("chatcmpl-tool-")
    assert "".join(c.arguments for c in first.tool_calls) == '{"a": "long'
    assert parser.feed(" text").tool_calls[0].arguments == " text"


def test_registry_names_hermes() -> None:
    assert "hermes" in tool_parser_names()
    with pytest.raises(KeyError):
        new_tool_parser("nope")


REQUIRED = json.dumps([
    {"name": "f", "parameters": {"s": "a]}\"b", "n": 1}},
    {"name": "g", "parameters": {}},
])


def test_required_output_becomes_one_call_per_element_for_every_split() -> None:
    expected = ("", [("f", '{"s": "a]}\\"b", "n": 1}'), ("g", "{}")])
    for pieces in splits(REQUIRED):
        assert run(RequiredToolParser, pieces) == expected


def test_required_output_that_is_not_calls_stays_content() -> None:
    assert run(RequiredToolParser, ["plain ", "text"]) == ("plain text", [])


def test_named_output_is_the_arguments_for_every_split() -> None:
    args = '{"city": "Paris"}'
    for pieces in splits(args):
        assert run(lambda: NamedToolParser("get_weather"), pieces) == (
            "", [("get_weather", args)]
        )
    assert run(lambda: NamedToolParser("f"), []) == ("", [("f", "")])
