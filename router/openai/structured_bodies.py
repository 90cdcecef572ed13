"""OpenAI / vLLM body fields asking for structured outputs -> one checked constraint.

Role: `structured_outputs_of(body)` reads OpenAI's `response_format` (`json_schema`,
`json_object`; `text` is the no-op), vLLM's `structured_outputs` extra body field
({json | json_object | regex | choice | grammar, disable_any_whitespace}) and vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and returns the one
`StructuredOutputsParams` they ask for, compiled once with llguidance to prove it compiles.

Invariants:
- At most one source per request; two are refused, naming the second.
- Every problem is an `InvalidFieldError` whose `param` is the exact body field at fault:
  `response_format.json_schema.schema`, `structured_outputs.regex`, `guided_choice`, ...
- Nothing here touches an engine: a bad schema, regex or grammar is a 400 before routing.
"""

from __future__ import annotations

from typing import Any

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.structured_grammar import check_compiles
from kvfleet.contracts.structured_outputs import KINDS, StructuredOutputsParams

# vLLM's old extra body fields -> the StructuredOutputsParams field each one sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_KEYS = (*KINDS, "disable_any_whitespace")


def structured_outputs_of(body: Any) -> StructuredOutputsParams | None:
    """The body's constraint (checked to compile), or None when it asks for none."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            found.append(constraint)
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        found.append(_from_structured_outputs(structured))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((_build({kind: value}, name), name))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(_source(param) for _, param in found)
        raise InvalidFieldError(
            _source(found[1][1]), f"only one structured-output constraint is allowed, got {names}"
        )
    params, param = found[0]
    check_compiles(params, param)
    return params


def _from_response_format(value: Any) -> tuple[StructuredOutputsParams, str] | None:
    if not isinstance(value, dict):
        raise InvalidFieldError("response_format", "response_format must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if kind != "json_schema":
        raise InvalidFieldError(
            "response_format.type",
            f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidFieldError(
            "response_format.json_schema",
            "response_format.json_schema must be an object with a `schema`",
        )
    param = "response_format.json_schema.schema"
    schema = spec.get("schema")
    if schema is None:
        raise InvalidFieldError(param, f"{param} is required")
    return _build({"json": schema}, param), param


def _from_structured_outputs(value: Any) -> tuple[StructuredOutputsParams, str]:
    if not isinstance(value, dict):
        raise InvalidFieldError("structured_outputs", "structured_outputs must be an object")
    fields = {key: item for key, item in value.items() if item is not None}
    for key in fields:
        if key not in _STRUCTURED_KEYS:
            raise InvalidFieldError(
                f"structured_outputs.{key}", f"structured_outputs.{key} is not supported"
            )
    if fields.get("json_object") is False:
        del fields["json_object"]
    params = StructuredOutputsParams(**fields)  # InvalidFieldError names structured_outputs.x
    return params, f"structured_outputs.{params.kind}"


def _build(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    """StructuredOutputsParams whose shape errors name `param` (the body field it came from)."""
    try:
        return StructuredOutputsParams(**fields)
    except InvalidFieldError as exc:
        message = str(exc).replace(exc.param or "structured_outputs", param, 1)
        raise InvalidFieldError(param, message) from None


def _source(param: str) -> str:
    """The top-level body field a param path belongs to."""
    return param.split(".", 1)[0]
