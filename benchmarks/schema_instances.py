"""Test instances for JSON schemas: valid and invalid JSON texts, labelled by `jsonschema`.

The vendored JSONSchemaBench subset ships schemas only, no instances, so the matcher-level
accept/reject check (benchmarks/structured_accept.py) needs its own. For each schema this
builds a few candidate documents: a minimal one (required properties only, lower bounds) and
a full one (every property, other enum/branch picks), printed with and without spaces, the
schema's own top-level `examples`, and mutations of the candidates meant to break them (wrong
top-level type, a required property dropped, a property of the wrong type, an unknown
property where `additionalProperties` is false, a value outside an `enum`, the text cut
short), and the document's keys in reverse order ("reordered": valid JSON Schema-wise, but
not in the declaration order a grammar engine fixes). Each text carries its variant's name.

Invariant: the generator's intent is never trusted. Every text is labelled by `jsonschema`
(draft 2020-12, formats checked), so "valid" means jsonschema accepts it and "invalid" means
it does not (or it is not JSON at all). Texts are deduplicated per schema.

Usage: python -m benchmarks.schema_instances OUT.json (over tests/data/jsonschemabench).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema

DATA = Path(__file__).parent.parent / "tests" / "data" / "jsonschemabench"
MAX_DEPTH = 12
FORMAT_SAMPLES = {
    "date-time": "2024-01-02T03:04:05Z", "date": "2024-01-02", "time": "03:04:05Z",
    "email": "a@example.com", "uri": "https://example.com/a", "uri-reference": "/a",
    "uuid": "123e4567-e89b-12d3-a456-426614174000", "ipv4": "10.0.0.1", "ipv6": "::1",
    "hostname": "example.com",
}
# Strings tried, in order, against a `pattern` (the first that matches is used).
PATTERN_TRIES = ["a", "abc", "A", "a1", "1", "12", "a_b", "a-b", "a.b", "ab:c", "2024-01-02",
                 "https://example.com", "#ffffff", "1.0.0", "iglu:com.a/b/jsonschema/1-0-0",
                 "a@b.co", "AB", "x", ""]


class _Gen:
    """Candidate documents for one schema; `full` picks the richer variant at every choice."""

    def __init__(self, root: Any, full: bool) -> None:
        self.root, self.full = root, full

    def resolve(self, ref: str) -> Any:
        node = self.root
        for part in ref.removeprefix("#").strip("/").split("/"):
            if part:
                node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    def value(self, schema: Any, depth: int = 0) -> Any:
        if not isinstance(schema, dict) or depth > MAX_DEPTH:
            return None
        if "$ref" in schema and isinstance(schema["$ref"], str):
            return self.value(self.resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][-1 if self.full else 0]
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.value(schema[key][-1 if self.full else 0], depth + 1)
        if isinstance(schema.get("allOf"), list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = self.resolve(part["$ref"]) if "$ref" in part else part
                for k, v in part.items():
                    merged[k] = ({**merged[k], **v} if isinstance(v, dict)
                                 and isinstance(merged.get(k), dict) else v)
            return self.value(merged, depth + 1)
        return self.typed(schema, _type_of(schema), depth)

    def typed(self, schema: dict, kind: str, depth: int) -> Any:
        if kind == "object":
            return self.obj(schema, depth)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "string":
            return self.string(schema)
        if kind in ("integer", "number"):
            return self.number(schema, kind)
        return {"boolean": not self.full, "null": None}.get(kind)

    def obj(self, schema: dict, depth: int) -> dict:
        props: dict = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
        required = [k for k in schema.get("required", []) if isinstance(k, str)]
        # Declaration order: llguidance (like xgrammar) emits properties in that order.
        keys = [k for k in props if self.full or k in required]
        keys += [k for k in required if k not in props]
        out = {k: self.value(props.get(k, {}), depth + 1) for k in keys}
        extra = schema.get("additionalProperties", True)
        for i in range(int(schema.get("minProperties", 0)) - len(out)):
            out[f"k{i}"] = self.value(extra, depth + 1) if isinstance(extra, dict) else "x"
        return out

    def array(self, schema: dict, depth: int) -> list:
        items = schema.get("items", {})
        count = max(int(schema.get("minItems", 0)), 2 if self.full else 0)
        count = min(count, int(schema.get("maxItems", count)))
        if isinstance(items, list):  # draft-4 tuple form
            return [self.value(item, depth + 1) for item in items[:max(count, len(items))]]
        return [self.value(items, depth + 1) for _ in range(count)]

    def string(self, schema: dict) -> str:
        if schema.get("format") in FORMAT_SAMPLES:
            return FORMAT_SAMPLES[schema["format"]]
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        if isinstance(schema.get("pattern"), str):
            for text in PATTERN_TRIES:
                if _matches(schema["pattern"], text) and len(text) >= low:
                    return text
        text = "text" if self.full else ""
        text = text + "a" * max(0, low - len(text))
        return text[:high] if isinstance(high, int) else text

    def number(self, schema: dict, kind: str) -> int | float:
        value: int | float = (7 if self.full else 0) if kind == "integer" else (
            2.25 if self.full else 0.5)
        if isinstance(schema.get("minimum"), int | float):
            value = max(value, schema["minimum"])
        if isinstance(schema.get("exclusiveMinimum"), int | float):
            value = max(value, schema["exclusiveMinimum"] + 1)
        if isinstance(schema.get("maximum"), int | float):
            value = min(value, schema["maximum"])
        return int(value) if kind == "integer" else value


def _type_of(schema: dict) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if isinstance(kind, str):
        return kind
    if "properties" in schema or "required" in schema:
        return "object"
    return "array" if "items" in schema else "any"


def _matches(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False


def _mutations(schema: dict, doc: Any) -> Iterator[tuple[str, Any]]:
    """(variant, document) meant to break `doc` (jsonschema has the last word on each)."""
    yield "wrong-type", "not an object" if isinstance(doc, dict) else {"unexpected": True}
    if not isinstance(doc, dict):
        return
    props: dict = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    for key in schema.get("required", [])[:1]:
        yield "drop-required", {k: v for k, v in doc.items() if k != key}
    wrong = {str: 12345, bool: "yes", int: "12", float: "1.5", dict: [], list: {}}
    for key, value in doc.items():
        if type(value) in wrong:
            yield "wrong-property-type", {**doc, key: wrong[type(value)]}
            break
    if schema.get("additionalProperties") is False:
        yield "extra-property", {**doc, "__unexpected_property": 1}
    for key, sub in props.items():
        if isinstance(sub, dict) and isinstance(sub.get("enum"), list) and key in doc:
            yield "not-in-enum", {**doc, key: "__not_in_enum__"}
            break
    if len(doc) > 1:  # valid JSON Schema-wise; the grammar fixes the order
        yield "reordered", dict(reversed(doc.items()))


def _texts(schema: Any) -> Iterator[tuple[str, str]]:
    docs = [("minimal", _Gen(schema, False).value(schema)),
            ("full", _Gen(schema, True).value(schema))]
    if isinstance(schema, dict) and isinstance(schema.get("examples"), list):
        docs += [("example", doc) for doc in schema["examples"]]
    for variant, doc in docs:
        yield variant, json.dumps(doc)
        yield variant + "-compact", json.dumps(doc, separators=(",", ":"))
        yield "truncated", json.dumps(doc)[:-1]
        if isinstance(schema, dict):
            yield from ((bad, json.dumps(d)) for bad, d in _mutations(schema, doc))


def label(schema: Any, text: str) -> bool:
    """jsonschema's verdict (draft 2020-12, formats checked); not JSON is invalid."""
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return validator.is_valid(doc)


def instances(schema: Any) -> list[dict[str, Any]]:
    """[{"variant", "text", "valid"}], deduplicated by text (first variant kept)."""
    unique: dict[str, str] = {}
    for variant, text in _texts(schema):
        unique.setdefault(text, variant)
    return [{"variant": variant, "text": text, "valid": label(schema, text)}
            for text, variant in unique.items()]


def main(argv: list[str]) -> None:
    out = {f"{f.parent.name}/{f.name}": instances(json.loads(f.read_text()))
           for f in sorted(DATA.glob("*/*.json"))}
    Path(argv[0]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    valid = sum(i["valid"] for rows in out.values() for i in rows)
    total = sum(len(rows) for rows in out.values())
    print(f"{len(out)} schemas, {total} instances: {valid} valid, {total - valid} invalid")


if __name__ == "__main__":
    main(sys.argv[1:])
