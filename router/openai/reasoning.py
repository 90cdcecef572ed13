"""Reasoning parsers (`--reasoning-parser`): split a model's `<think>...</think>` reasoning
from its answer, like vLLM's `deepseek_r1` and `qwen3` parsers.

Role: one parser instance per choice turns output text, fed piece by piece, into reasoning
and content deltas; the chat layer renders them as `reasoning_content` (and vLLM's newer
name `reasoning`) and `content`, and runs the tool-call parser on the content only.

Invariants:
- Split invariance, as for tool parsers: every split of an output yields the same
  reasoning and content as the whole output (the non-streamed response feeds it whole).
- The markers never appear in either field; text that may start a marker is held back.
- `deepseek_r1`: the output is reasoning from its first character (the chat template opens
  the `<think>` block; one the model writes itself is dropped) up to `</think>`; without a
  `</think>` it is all reasoning. `qwen3`: reasoning only when the output opens with
  `<think>` (Qwen3 writes it itself), up to `</think>`; otherwise it is all content (thinking
  disabled). Text after `</think>` is content, as generated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.openai.tool_parsers.base import held_suffix

START = "<think>"
END = "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ThinkParser:
    """`<think>` reasoning `</think>` content. `implicit_start`: reasoning even when the
    output does not open with `<think>` (the prompt did)."""

    def __init__(self, implicit_start: bool) -> None:
        self._implicit = implicit_start
        self._pending = ""
        # None until the opening is known; then "reasoning" or "content".
        self._state: str | None = None

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._state is None and not self._open(final):
            return out
        if self._state == "content":
            out.content, self._pending = self._pending, ""
            return out
        end = self._pending.find(END)
        if end >= 0:
            out.reasoning = self._pending[:end]
            out.content = self._pending[end + len(END):]
            self._pending, self._state = "", "content"
            return out
        keep = 0 if final else held_suffix(self._pending, END)
        cut = len(self._pending) - keep
        out.reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def _open(self, final: bool) -> bool:
        """Decide, from the output's first characters, how it starts; False: not yet known."""
        if self._pending.startswith(START):
            self._pending = self._pending[len(START):]
            self._state = "reasoning"
        elif START.startswith(self._pending) and not final:
            return False  # may still become "<think>"
        else:
            self._state = "reasoning" if self._implicit else "content"
        return True


_PARSERS: dict[str, Callable[[], ThinkParser]] = {
    "deepseek_r1": lambda: ThinkParser(implicit_start=True),
    "qwen3": lambda: ThinkParser(implicit_start=False),
}


# (start marker if the reasoning is optional, end marker) per parser, for a structured-output
# constraint that must apply after the reasoning (engine.structured.reasoning_gate).
_GRAMMAR_MARKERS: dict[str, tuple[str | None, str]] = {
    "deepseek_r1": (None, END),
    "qwen3": (START, END),
}


def grammar_markers(name: str) -> tuple[str | None, str]:
    """(reasoning_start, reasoning_end) a constraint carries under parser `name`."""
    return _GRAMMAR_MARKERS[name]


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def new_reasoning_parser(name: str) -> ThinkParser:
    """A fresh parser for one output; KeyError for an unknown name."""
    return _PARSERS[name]()
