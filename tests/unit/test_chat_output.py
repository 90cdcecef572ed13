"""Chat output rendering with tool calls and reasoning: the whole message, SSE deltas that
add up to it (through `StreamRenderer`, as the router streams them), finish reasons."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvfleet.v1 import common_pb2, router_pb2
from router.openai.chat_output import ChatOutputPlan, whole_message
from router.openai.render import Choices
from router.openai.responses import StreamRenderer
from router.openai.tools import ToolChoice
from tests.unit.stream_splits import splits

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def make_plan(mode: str = "auto", reasoning: str | None = None, parallel: bool = True,
              name: str | None = None) -> ChatOutputPlan:
    return ChatOutputPlan(ToolChoice(mode, name), parallel,  # type: ignore[arg-type]
                          "hermes", reasoning)


def responses(pieces: list[str], finish: str = "stop") -> list[router_pb2.RouterGenerateResponse]:
    out = [router_pb2.RouterGenerateResponse(text_delta=p, token_ids=[1]) for p in pieces]
    out.append(router_pb2.RouterGenerateResponse(
        finish_reason=finish, usage=common_pb2.Usage(prompt_tokens=3)))
    return out


def renderer(plan: ChatOutputPlan) -> StreamRenderer:
    return StreamRenderer(Choices(n=1, kind="chat"), "chatcmpl-x", 0, "m", plan=plan)


def streamed(plan: ChatOutputPlan, pieces: list[str], finish: str = "stop") -> dict[str, Any]:
    """The message the OpenAI SDK accumulates from the chunks, and the finish reason."""
    r = renderer(plan)
    chunks = [c for m in responses(pieces, finish) for c in asyncio.run(r.chunks((0, m)))]
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish_reason = None
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        assert delta.get("reasoning") == delta.get("reasoning_content")
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls", []):
            calls = message["tool_calls"]
            if "id" in call:
                assert call["index"] not in calls and call["type"] == "function"
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
        finish_reason = choice["finish_reason"] or finish_reason
    message["tool_calls"] = list(message["tool_calls"].values())
    message["finish_reason"] = finish_reason
    return message


def whole(plan: ChatOutputPlan, text: str, finish: str = "stop") -> dict[str, Any]:
    r = renderer(plan)
    for m in responses([text], finish):
        asyncio.run(r.fold((0, m)))
    (choice,) = r.body()["choices"]
    message = choice["message"]
    return {
        "content": message["content"] or "",
        "reasoning_content": message.get("reasoning_content") or "",
        "tool_calls": [[c["function"]["name"], c["function"]["arguments"]]
                       for c in message.get("tool_calls", [])],
        "finish_reason": choice["finish_reason"],
    }


OUTPUTS = [
    (make_plan(), "Checking." + CALL),
    (make_plan(), "No call here <tool"),
    (make_plan(reasoning="deepseek_r1"), "Hmm, weather.</think>\n" + CALL + CALL),
    (make_plan(reasoning="qwen3", parallel=False), "<think>x</think>" + CALL + CALL),
    (make_plan("none", reasoning="qwen3"), "<think>a</think>b <tool_call>"),
    (make_plan("required"), json.dumps([{"name": "f", "parameters": {"x": [1]}}])),
    (make_plan("named", name="f"), '{"x": 1}'),
]


@pytest.mark.parametrize("plan,text", OUTPUTS)
def test_streamed_deltas_add_up_to_the_whole_message(plan: ChatOutputPlan, text: str) -> None:
    expected = whole(plan, text)
    for pieces in list(splits(text))[::7]:
        assert streamed(plan, pieces) == expected, pieces


def test_auto_calls_become_tool_calls_with_ids_and_finish_reason() -> None:
    message, called = whole_message(make_plan(), "Checking.\n" + CALL)
    assert called and message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    result = whole(make_plan(), CALL)
    assert result["finish_reason"] == "tool_calls" and result["content"] == ""
    assert whole(make_plan(), CALL, finish="length")["finish_reason"] == "length"
    assert whole(make_plan("named", name="f"), "{}")["finish_reason"] == "stop"
    assert whole(make_plan("required"), '[{"name": "f", "parameters": {}}]')[
        "finish_reason"] == "tool_calls"


def test_content_is_null_only_beside_calls_or_reasoning() -> None:
    assert whole_message(make_plan(), CALL)[0]["content"] is None
    assert whole_message(make_plan(), "")[0]["content"] == ""
    only_reasoning = whole_message(make_plan("none", "deepseek_r1"), "thinking")[0]
    assert only_reasoning["content"] is None
    assert only_reasoning["reasoning_content"] == only_reasoning["reasoning"] == "thinking"
    assert "reasoning_content" not in whole_message(make_plan(), "x")[0]
    assert "tool_calls" not in whole_message(make_plan("none", "qwen3"), "x")[0]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    message, _ = whole_message(make_plan(parallel=False), CALL + CALL)
    assert len(message["tool_calls"]) == 1


def test_stream_starts_with_the_role_and_never_leaks_a_marker() -> None:
    r = renderer(make_plan())
    first = asyncio.run(r.chunks((0, router_pb2.RouterGenerateResponse(text_delta="Hi <tool_"))))
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": ""}, {"content": "Hi"}]
