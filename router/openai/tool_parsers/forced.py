"""Parsers for forced tool choices, whose output a grammar holds to a JSON schema.

Role: `tool_choice: {"type": "function", "function": {"name": N}}` (the output is N's
arguments object: `NamedToolParser`) and `tool_choice: "required"` (the output is a JSON array
of `{"name", "parameters"}` objects: `RequiredToolParser`), as vLLM renders them. The schemas
are `router.openai.tools.tool_choice_schema`'s.

Invariants: `base`'s split invariance. The named call's arguments stream as generated; a
required call is sent whole once its array element closes. An output that is not what the
schema allows (only possible while no grammar enforces it) yields no call: for `required` it
is then returned as content, so nothing generated is lost.
"""

from __future__ import annotations

import json

from router.openai.tool_parsers.base import ToolCallDelta, ToolDelta, new_tool_call_id


class NamedToolParser:
    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if not self._started:
            self._started = True
            out.tool_calls.append(ToolCallDelta(0, new_tool_call_id(), self._name))
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> ToolDelta:
        return self.feed("")


class RequiredToolParser:
    """Scans the array one character at a time, tracking strings and nesting, to find where
    each top-level element ends."""

    def __init__(self) -> None:
        self._text = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._element_start = -1
        self._calls = 0

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        base = len(self._text)
        self._text += text
        for offset, char in enumerate(text):
            self._scan(char, base + offset, out)
        return out

    def finish(self) -> ToolDelta:
        return ToolDelta(content=self._text if self._calls == 0 else "")

    def _scan(self, char: str, position: int, out: ToolDelta) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "[{":
            if self._depth == 1 and char == "{":
                self._element_start = position
            self._depth += 1
        elif char in "]}":
            self._depth -= 1
            if self._depth == 1 and char == "}" and self._element_start >= 0:
                self._element(self._text[self._element_start: position + 1], out)
                self._element_start = -1

    def _element(self, source: str, out: ToolDelta) -> None:
        try:
            value = json.loads(source)
        except json.JSONDecodeError:
            return
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return
        arguments = json.dumps(value.get("parameters", {}), ensure_ascii=False)
        index, self._calls = self._calls, self._calls + 1
        out.tool_calls.append(ToolCallDelta(index, new_tool_call_id(), value["name"]))
        out.tool_calls.append(ToolCallDelta(index, arguments=arguments))
