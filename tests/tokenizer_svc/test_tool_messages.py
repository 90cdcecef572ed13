"""Tools, assistant tool calls and tool results reach the chat template through the
Tokenize RPC (in process: the servicer with a tool-aware template on the tiny tokenizer)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet.v1 import common_pb2, tokenizer_pb2
from tests.fixtures.tool_template import TOOL_TEMPLATE
from tokenizer_svc.service import TokenizerServicer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def servicer(tiny_model_dir: Path) -> TokenizerServicer:
    return TokenizerServicer.from_model_dir(tiny_model_dir, chat_template=TOOL_TEMPLATE)


def render(servicer: TokenizerServicer, messages: common_pb2.ChatMessages) -> str:
    request = tokenizer_pb2.TokenizeRequest(messages=messages)
    response = asyncio.run(servicer.Tokenize(request, None))  # type: ignore[arg-type]
    return response.prompt


def conversation(arguments: str, tools: list[Any] | None) -> common_pb2.ChatMessages:
    messages = common_pb2.ChatMessages(tools_json=json.dumps(tools) if tools else "")
    messages.messages.add(role="user", content="Weather in Paris?")
    assistant = messages.messages.add(role="assistant")
    assistant.tool_calls.add(id="call_1", name="get_weather", arguments=arguments)
    messages.messages.add(role="tool", content="12 C", tool_call_id="call_1")
    return messages


def test_tools_calls_and_results_are_rendered(servicer: TokenizerServicer) -> None:
    prompt = render(servicer, conversation('{"city": "Paris"}', TOOLS))
    assert prompt.startswith('<|im_start|>system\n<tools>{"name": "get_weather"')
    # Arguments reach the template parsed, so `tojson` writes them once, not as a string.
    assert ('<tool_call>{"id": "call_1", "name": "get_weather", "arguments": '
            '{"city": "Paris"}}</tool_call>') in prompt
    assert "<tool_response id=call_1>12 C</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_no_tools_and_unparsable_arguments(servicer: TokenizerServicer) -> None:
    prompt = render(servicer, conversation("not json", None))
    assert "<tools>" not in prompt
    assert '"arguments": "not json"' in prompt


def test_bad_tools_json_is_refused(servicer: TokenizerServicer) -> None:
    messages = common_pb2.ChatMessages(tools_json='{"a": 1}')
    messages.messages.add(role="user", content="hi")
    with pytest.raises(ValueError, match="tools must be a JSON array"):
        render(servicer, messages)
