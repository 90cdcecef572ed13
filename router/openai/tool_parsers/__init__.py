"""Tool-call parsers by name (`--tool-call-parser`), like vLLM's ToolParserManager.

Role: the registry. A parser is a class whose instances follow `base.ToolParser` (one
instance per choice: parsers keep per-output state). Add one with `@register("name")`;
`keep_special_tokens=True` when its markers may be special tokens, which the engine must then
not skip from the text (vLLM's hermes parser turns `skip_special_tokens` off the same way).
"""

from __future__ import annotations

from collections.abc import Callable

from router.openai.tool_parsers.base import ToolCallDelta, ToolDelta, ToolParser
from router.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from router.openai.tool_parsers.hermes import HermesToolParser

__all__ = [
    "NamedToolParser", "RequiredToolParser", "ToolCallDelta", "ToolDelta", "ToolParser",
    "keeps_special_tokens", "new_tool_parser", "register", "tool_parser_names",
]

_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}
# Hermes models (Hermes-2-Pro) make <tool_call> a special token.
_KEEP_SPECIAL: set[str] = {"hermes"}


def register(name: str, keep_special_tokens: bool = False) -> Callable[[type], type]:
    def add(cls: type) -> type:
        _PARSERS[name] = cls
        if keep_special_tokens:
            _KEEP_SPECIAL.add(name)
        return cls
    return add


def keeps_special_tokens(name: str) -> bool:
    """Whether requests parsed by `name` must keep special tokens in their text."""
    return name in _KEEP_SPECIAL


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def new_tool_parser(name: str) -> ToolParser:
    """A fresh parser for one output; KeyError for an unknown name."""
    return _PARSERS[name]()
