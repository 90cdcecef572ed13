"""Tool-call parsers by name (`--tool-call-parser`), like vLLM's ToolParserManager.

Role: the registry. A parser is a class whose instances follow `base.ToolParser` (one
instance per choice: parsers keep per-output state). Add one with `@register("name")`.
"""

from __future__ import annotations

from collections.abc import Callable

from router.openai.tool_parsers.base import ToolCallDelta, ToolDelta, ToolParser
from router.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from router.openai.tool_parsers.hermes import HermesToolParser

__all__ = [
    "NamedToolParser", "RequiredToolParser", "ToolCallDelta", "ToolDelta", "ToolParser",
    "new_tool_parser", "register", "tool_parser_names",
]

_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}


def register(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        _PARSERS[name] = cls
        return cls
    return add


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def new_tool_parser(name: str) -> ToolParser:
    """A fresh parser for one output; KeyError for an unknown name."""
    return _PARSERS[name]()
