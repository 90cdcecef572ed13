"""Structured-output params -> an llguidance grammar, and the check that it compiles.

Role: the one translation of `StructuredOutputsParams` into llguidance's grammar text, used by
the router (to refuse a bad schema/regex/grammar with HTTP 400 before any engine work) and by
the engine's llguidance backend (engine.structured), so both agree on what compiles.

Invariants:
- `check_compiles` raises `InvalidFieldError` whose `param` is the caller's exact body field
  (e.g. `response_format.json_schema.schema`), default `structured_outputs.<kind>`.
- Checking needs no tokenizer (llguidance validates the grammar alone, in about a millisecond
  for common schemas) and is cached by the constraint's key; llguidance is imported on first
  use, so importing kvfleet.contracts stays light.
"""

from __future__ import annotations

import functools
import json

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.structured_outputs import StructuredOutputsParams


def llguidance_grammar(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the constraint (ValueError if it cannot be built)."""
    import llguidance
    from llguidance import LLMatcher

    kind = params.kind
    if kind in ("json", "json_object"):
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        return LLMatcher.grammar_from_json_schema(params.schema or {}, defaults=options)  # type: ignore[arg-type]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex or "")
    if kind == "choice":
        # Lark string literals take JSON's escapes; llguidance's own "choice" does the same.
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(item) for item in params.choice or [])
        )
    # "grammar" accepts Lark or GBNF (llama.cpp's `root ::= ...`), converted to Lark.
    return llguidance.grammar_from("grammar", params.grammar or "")


def check_compiles(params: StructuredOutputsParams, param: str | None = None) -> str:
    """The grammar text if it compiles; else InvalidFieldError naming `param`."""
    field = param or f"structured_outputs.{params.kind}"
    grammar, problem = _compiled(params.key)
    if grammar is None:
        raise InvalidFieldError(field, f"{field} is invalid: {problem}")
    return grammar


@functools.lru_cache(maxsize=256)
def _compiled(key: str) -> tuple[str | None, str]:
    """(grammar text, "") or (None, the problem), by constraint key: a schema sent again and
    again (every request of an app) is checked once."""
    from llguidance import LLMatcher

    kind, value, disable_any_whitespace = json.loads(key)
    params = StructuredOutputsParams(
        **{kind: value}, disable_any_whitespace=disable_any_whitespace
    )
    try:
        grammar = llguidance_grammar(params)
    except ValueError as exc:
        return None, str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        return None, messages[0].strip() if messages else "it does not compile"
    return grammar, ""
