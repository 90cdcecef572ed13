"""Chat output -> OpenAI message fields: reasoning, content and tool calls, whole or streamed.

Role: `plan_chat_output` decides, per request, how its choices' text is read (router flags
`ChatOutputConfig` + the body's tool fields) and refuses what the flags do not allow;
`ChatOutputParser` reads one choice's text piece by piece (reasoning parser first, then the
tool-call parser on the content only, as vLLM does); `whole_message` and `stream_delta`
render the result as a `message` or a chunk's `delta`.

Invariants:
- The non-streamed message is the streamed deltas fed all at once, so the two agree
  (each parser is split-invariant).
- `finish_reason` becomes "tool_calls" when calls were parsed under `auto` or `required`
  and the engine stopped on its own ("stop"); a named choice keeps "stop", like OpenAI.
- With `parallel_tool_calls: false` only the first call is returned.
- A request with no tool parsing (`tool_choice` "none") and no reasoning parser has no plan:
  its text is rendered as plain content, exactly as before tool calling existed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.v1 import router_pb2
from router.openai.reasoning import ThinkParser, grammar_markers, new_reasoning_parser
from router.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolCallDelta,
    ToolParser,
    keeps_special_tokens,
    new_tool_parser,
)
from router.openai.tools import ToolChoice, constrain_to_schema, tool_choice_schema

Json = dict[str, Any]
AUTO_TOOL_CHOICE_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


@dataclass(frozen=True)
class ChatOutputConfig:
    """The router's flags: `--enable-auto-tool-choice`, `--tool-call-parser`,
    `--reasoning-parser`."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass(frozen=True)
class ChatOutputPlan:
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    tool_call_parser: str | None
    reasoning_parser: str | None

    def new_parser(self) -> ChatOutputParser:
        return ChatOutputParser(self)

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        if called and engine_reason == "stop" and self.tool_choice.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


def plan_chat_output(
    tools: list[dict[str, Any]] | None, tool_choice: ToolChoice, parallel_tool_calls: bool,
    config: ChatOutputConfig, requests: list[router_pb2.RouterGenerateRequest],
) -> ChatOutputPlan | None:
    """How the request's output is read; constrains the requests' output for a forced choice.
    InvalidFieldError when `auto` is asked of a router without a tool-call parser."""
    auto_ready = config.enable_auto_tool_choice and config.tool_call_parser is not None
    if tool_choice.mode == "auto" and not auto_ready:
        raise InvalidFieldError("tool_choice", AUTO_TOOL_CHOICE_FLAGS)
    schema = tool_choice_schema(tools, tool_choice, parallel_tool_calls)
    keep_special = tool_choice.mode == "auto" and keeps_special_tokens(
        config.tool_call_parser or "")
    for request in requests:
        if schema is not None:
            constrain_to_schema(request.sampling_params, schema)
        if keep_special:  # the call markers must reach the parser
            request.sampling_params.skip_special_tokens = False
        if config.reasoning_parser and request.sampling_params.HasField("structured_outputs"):
            # The grammar constrains the content, after the reasoning (as vLLM's does).
            start, end = grammar_markers(config.reasoning_parser)
            constraint = request.sampling_params.structured_outputs
            if start is not None:
                constraint.reasoning_start = start
            constraint.reasoning_end = end
    if tool_choice.mode == "none" and config.reasoning_parser is None:
        return None
    return ChatOutputPlan(
        tool_choice, parallel_tool_calls, config.tool_call_parser, config.reasoning_parser
    )


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ChatDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class ChatOutputParser:
    """One choice's text -> reasoning, content and tool-call deltas."""

    def __init__(self, plan: ChatOutputPlan) -> None:
        self._plan = plan
        self._reasoning: ThinkParser | None = (
            new_reasoning_parser(plan.reasoning_parser) if plan.reasoning_parser else None
        )
        self._tools = _tool_parser(plan)
        self.called = False  # whether any call was returned

    def feed(self, text: str) -> ChatDelta:
        if self._reasoning is None:
            return self._content(text)
        split = self._reasoning.feed(text)
        out = self._content(split.content)
        out.reasoning = split.reasoning
        return out

    def finish(self) -> ChatDelta:
        out = ChatDelta()
        if self._reasoning is not None:
            split = self._reasoning.finish()
            out.reasoning = split.reasoning
            out.extend(self._content(split.content))
        if self._tools is not None:
            tail = self._tools.finish()
            out.extend(ChatDelta(content=tail.content, tool_calls=self._kept(tail.tool_calls)))
        return out

    def _content(self, text: str) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(content=text)
        parsed = self._tools.feed(text)
        return ChatDelta(content=parsed.content, tool_calls=self._kept(parsed.tool_calls))

    def _kept(self, calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
        if not self._plan.parallel_tool_calls:
            calls = [c for c in calls if c.index == 0]
        self.called = self.called or bool(calls)
        return calls


def _tool_parser(plan: ChatOutputPlan) -> ToolParser | None:
    choice = plan.tool_choice
    if choice.mode == "named":
        assert choice.name is not None
        return NamedToolParser(choice.name)
    if choice.mode == "required":
        return RequiredToolParser()
    if choice.mode == "auto" and plan.tool_call_parser is not None:
        return new_tool_parser(plan.tool_call_parser)
    return None


def whole_message(plan: ChatOutputPlan, text: str) -> tuple[Json, bool]:
    """The `message` of a non-streamed choice, and whether it has tool calls."""
    parser = plan.new_parser()
    delta = parser.feed(text)
    delta.extend(parser.finish())
    calls: dict[int, Json] = {}
    for call in delta.tool_calls:
        if call.id is not None:
            calls[call.index] = {"id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}
        calls[call.index]["function"]["arguments"] += call.arguments
    empty = not delta.content and (calls or delta.reasoning)
    message: Json = {"role": "assistant", "content": None if empty else delta.content}
    if plan.tool_choice.mode != "none":
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if plan.reasoning_parser is not None:
        reasoning = delta.reasoning or None
        message["reasoning_content"] = message["reasoning"] = reasoning
    return message, bool(calls)


def stream_delta(delta: ChatDelta) -> Json:
    """A chunk's `delta` (empty when there is nothing to send). A call's header and argument
    fragments of one chunk are merged into one entry, so each index appears once."""
    out: Json = {}
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    entries: dict[int, Json] = {}
    for call in delta.tool_calls:
        entry = entries.get(call.index)
        if entry is None:
            entry = entries[call.index] = {"index": call.index}
            if call.id is not None:
                entry.update(id=call.id, type="function",
                             function={"name": call.name, "arguments": ""})
            else:
                entry["function"] = {"arguments": ""}
        entry["function"]["arguments"] += call.arguments
    if entries:
        out["tool_calls"] = list(entries.values())
    return out
