"""What every tool-call parser produces: content text and tool-call deltas, fed piece by piece.

Role: the streaming contract shared by the parsers (`hermes`, the forced `required` / named
ones) and the chat output layer that renders them.

Invariants (each parser's tests check them):
- Split invariance: for any split of a model output into pieces, the deltas of
  `feed(piece)` for every piece, then `finish()`, add up to the same content and the same
  calls (name, arguments) as feeding the whole output at once. The non-streamed response is
  built by feeding the whole output, so streamed and non-streamed responses agree.
- A call's first delta carries its index, id and name; later ones only argument fragments.
  Indexes count from 0 in order of appearance.
- Markers a parser recognizes never leak into content, not even partially: text that may
  be the start of a marker is held back until it is known not to be one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCallDelta:
    index: int
    # Set on a call's first delta only.
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ToolDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class ToolParser(Protocol):
    def feed(self, text: str) -> ToolDelta:
        """The deltas `text` (the output's next piece) completes."""
        ...

    def finish(self) -> ToolDelta:
        """The deltas still held back once the output has ended."""
        ...


def new_tool_call_id() -> str:
    """vLLM's id for a call the server parsed (`chatcmpl-tool-<hex>`)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: the part
    that must wait for more text before anyone can tell whether it starts the marker."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
