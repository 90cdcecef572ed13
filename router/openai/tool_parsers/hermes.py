"""The Hermes / Qwen tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Role: `--tool-call-parser hermes`. Text outside the markers is content; each marked body is
one call. Streams a call's arguments as they are generated.

Invariants (besides `base`'s split invariance):
- A body that opens as `{"name": "<name>", "arguments": <first character>` is a call from
  that point on: its name is sent at once and its arguments stream. Its arguments are the
  source text from that character up to the body's last `}` (the object's own closing brace
  excluded), whitespace trimmed, so the stream never has to take back a fragment: text is
  sent only once a later `}` shows it lies inside the arguments. A body cut off with no
  closing brace (max_tokens) keeps everything generated.
- Any other body is judged whole (at `</tool_call>` or the end): a JSON object with a string
  `name` and `arguments` is a call (arguments re-serialized as JSON); anything else goes back
  into the content verbatim, markers included, with the whitespace before it.
- Whitespace right before a call and at the end of an output with calls is dropped; with no
  call at all the content is exactly the output.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from router.openai.tool_parsers.base import ToolCallDelta, ToolDelta, held_suffix, new_tool_call_id

START = "<tool_call>"
END = "</tool_call>"
# The opening of a streamable body, up to the arguments' first character (not consumed).
_OPENING = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)', re.DOTALL
)


@dataclass
class _Call:
    """The body being read: once streaming, where its arguments start and how much of them
    has been sent."""

    body: str = ""
    index: int | None = None
    args_start: int = 0
    sent: int = 0


class HermesToolParser:
    def __init__(self) -> None:
        self._pending = ""  # unread text: may hold the start of a marker
        self._call: _Call | None = None  # inside <tool_call> ... when set
        self._space = ""  # trailing whitespace of the content, held back
        self._space_before_call = ""
        self._calls = 0

    def feed(self, text: str) -> ToolDelta:
        self._pending += text
        out = ToolDelta()
        self._drain(out, final=False)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        self._drain(out, final=True)
        if self._calls == 0:
            out.content += self._space
        self._space = ""
        return out

    def _drain(self, out: ToolDelta, final: bool) -> None:
        while True:
            if self._call is None:
                if not self._read_outside(out, final):
                    return
            elif not self._read_call(out, final):
                return

    def _read_outside(self, out: ToolDelta, final: bool) -> bool:
        """Content up to the next call; True when a call starts."""
        start = self._pending.find(START)
        if start < 0:
            keep = 0 if final else held_suffix(self._pending, START)
            self._content(out, self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        self._content(out, self._pending[:start])
        self._pending = self._pending[start + len(START):]
        self._space_before_call, self._space = self._space, ""
        self._call = _Call()
        return True

    def _read_call(self, out: ToolDelta, final: bool) -> bool:
        """The call's body up to `</tool_call>`; True when the call ended there."""
        call = self._call
        assert call is not None
        end = self._pending.find(END)
        closed = end >= 0
        if closed:
            call.body += self._pending[:end]
            self._pending = self._pending[end + len(END):]
        else:
            keep = 0 if final else held_suffix(self._pending, END)
            call.body += self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
        self._stream_arguments(call, out)
        if closed or final:
            self._close(call, out, closed)
            self._call = None
        return closed

    def _stream_arguments(self, call: _Call, out: ToolDelta) -> None:
        if call.index is None:
            opening = _OPENING.match(call.body)
            name = _json_string(opening.group(1)) if opening else None
            if opening is None or name is None:
                return
            call.index, call.args_start = self._start_call(out, name), opening.end()
        self._send(call, out, _arguments(call.body[call.args_start:]))

    def _close(self, call: _Call, out: ToolDelta, closed: bool) -> None:
        if call.index is not None:
            self._send(call, out, _arguments(call.body[call.args_start:]))
            return
        parsed = _whole_call(call.body)
        if parsed is None:  # not a call: back into the content, as generated
            raw = START + call.body + (END if closed else "")
            self._content(out, self._space_before_call + raw)
            return
        index = self._start_call(out, parsed[0])
        out.tool_calls.append(ToolCallDelta(index, arguments=parsed[1]))

    def _start_call(self, out: ToolDelta, name: str) -> int:
        index, self._calls = self._calls, self._calls + 1
        self._space_before_call = ""
        out.tool_calls.append(ToolCallDelta(index, new_tool_call_id(), name))
        return index

    def _send(self, call: _Call, out: ToolDelta, arguments: str) -> None:
        assert call.index is not None
        if len(arguments) > call.sent:
            out.tool_calls.append(ToolCallDelta(call.index, arguments=arguments[call.sent:]))
            call.sent = len(arguments)

    def _content(self, out: ToolDelta, text: str) -> None:
        # Trailing whitespace waits: it is dropped if a call follows it.
        text = self._space + text
        kept = text.rstrip()
        if kept:
            out.content += kept
            self._space = text[len(kept):]
        else:
            self._space = text


def _arguments(region: str) -> str:
    """The arguments in `region` (the body from the arguments' first character) known so far.

    Up to the last `}`, which closes the call's object unless a later one will: either way
    what precedes it is arguments. With no `}` yet, everything is (a `}` to come would follow
    it; a body cut off before one keeps it all). So each value extends the previous one."""
    brace = region.rfind("}")
    return (region[:brace] if brace >= 0 else region).rstrip()


def _json_string(source: str) -> str | None:
    try:
        value = json.loads(f'"{source}"')
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete body, or None when it is not a call."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if "arguments" not in value:
        return None
    arguments = value["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return value["name"], text
