"""Chat messages and tools (protobuf) -> the variables a chat template renders.

Role: the one place the Tokenize RPC's chat input becomes template input, so every caller
(router, /tokenize) gets the same prompt for the same conversation. ValueError names the
offending field (the interceptor turns it into INVALID_ARGUMENT).

Invariants:
- Messages carry only the keys a template may test: `tool_calls` on assistant turns that
  made calls, `tool_call_id` on tool turns that answer one, `name` when given. Absent keys
  stay absent (templates test `message.tool_calls is defined`).
- A tool call's `arguments` reach the template parsed (a dict), as vLLM passes them:
  templates write `tool_call.arguments | tojson`, which would quote a string a second time.
  Arguments that are not JSON stay the client's string.
- `tools` is the OpenAI `tools` array as sent (each `{"type": "function", "function": ...}`),
  or None when the request has none, so templates' `{% if tools %}` sees no tools.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvfleet.v1 import common_pb2

# OpenAI's chat roles ("developer" is the newer name for "system").
CHAT_ROLES = ("assistant", "developer", "system", "tool", "user")


def validate_messages(messages: Sequence[common_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as template input; ValueError naming the first bad message."""
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}; "
                f"got {message.role!r}"
            )
        out.append(_template_message(message))
    return out


def parse_tools(tools_json: str) -> list[Any] | None:
    """The `tools` template variable; ValueError when `tools_json` is not a JSON array."""
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"tools is not valid JSON: {e}") from None
    if not isinstance(tools, list):
        raise ValueError("tools must be a JSON array")
    return tools or None


def _template_message(message: common_pb2.ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _arguments(call.arguments)}}
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    if message.name:
        entry["name"] = message.name
    return entry


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
