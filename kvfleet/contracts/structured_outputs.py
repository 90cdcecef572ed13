"""Structured outputs (grammar-constrained decoding): what a request asks its output to match.

`StructuredOutputsParams` is vLLM's: exactly one of `json` (a JSON schema, as a dict or a
JSON string), `json_object=True` (any JSON object), `regex`, `choice` (one of these strings)
or `grammar` (Lark, or GBNF/EBNF as llama.cpp writes it). It rides on
`SamplingParams.structured_outputs`; the router builds it from OpenAI's `response_format`,
vLLM's `structured_outputs` body field or the old `guided_*` fields, and a tool-call parser
asks for a schema with `StructuredOutputsParams(json=schema)`.

Invariants:
- Construction checks the shape only (one constraint, right types; a `json` string must be
  JSON): a problem is an `InvalidFieldError` naming `structured_outputs.<field>`. Whether the
  grammar compiles is `kvfleet.contracts.structured_grammar`'s job (router and engine both).
- `key` is the same for two params that compile to the same grammar (the compile cache key);
  schema key order is kept, since it orders the generated object's properties.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvfleet.contracts.errors import InvalidFieldError

# The constraint fields, in vLLM's order; exactly one is set.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # JSON only: no whitespace outside strings beyond the separators (vLLM's name).
    disable_any_whitespace: bool = False
    # The constraint starts after the model's reasoning (engine.structured.reasoning_gate):
    # set by the router from its --reasoning-parser. `reasoning_end` alone: the output opens
    # in reasoning (the prompt opened it); with `reasoning_start`, only when it opens with it.
    reasoning_start: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        set_fields = [kind for kind in KINDS if self._is_set(kind)]
        if len(set_fields) != 1:
            raise InvalidFieldError(
                "structured_outputs",
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(set_fields) or 'none'}",
            )
        self._check_types(set_fields[0])
        for name in ("reasoning_start", "reasoning_end"):
            marker = getattr(self, name)
            if marker is not None and (not isinstance(marker, str) or not marker):
                param = f"structured_outputs.{name}"
                raise InvalidFieldError(param, f"{param} must be a non-empty string")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise InvalidFieldError("structured_outputs.reasoning_end",
                                    "structured_outputs.reasoning_start needs reasoning_end")

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is not None and value is not False

    def _check_types(self, kind: str) -> None:
        value = getattr(self, kind)
        param = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as exc:
                    raise InvalidFieldError(param, f"{param} is not valid JSON: {exc}") from exc
                value = parsed
            if not isinstance(value, dict):
                raise InvalidFieldError(param, f"{param} must be a JSON schema object")
        elif kind == "json_object":
            if value is not True:
                raise InvalidFieldError(param, f"{param} must be true when set")
        elif kind == "choice":
            if not isinstance(value, list) or not value:
                raise InvalidFieldError(param, f"{param} must be a non-empty list of strings")
            if not all(isinstance(item, str) for item in value):
                raise InvalidFieldError(param, f"{param} must hold strings only")
        elif not isinstance(value, str) or not value:
            raise InvalidFieldError(param, f"{param} must be a non-empty string")

    @property
    def kind(self) -> str:
        """The one constraint field that is set."""
        return next(kind for kind in KINDS if self._is_set(kind))

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema (parsed) for `json`; {"type": "object"} for `json_object`."""
        if self.json_object:
            return {"type": "object"}
        if self.json is None:
            return None
        parsed: dict[str, Any] = json.loads(self.json) if isinstance(self.json, str) else self.json
        return parsed

    @property
    def key(self) -> str:
        """A canonical string of the constraint (equal keys compile to equal grammars)."""
        kind = self.kind
        value: Any = self.schema if kind == "json" else getattr(self, kind)
        return json.dumps([kind, value, self.disable_any_whitespace], separators=(",", ":"))
