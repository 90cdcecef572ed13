"""Reading a JSON or YAML configuration file with errors that name the line and the field.

Role: `read_document` parses the file (YAML when the name ends in .yaml/.yml, JSON
otherwise) and returns its data plus a `Locator`; `Locator.line_of(("tenants", "acme",
"tokens_per_minute"))` gives the line a field sits on, so a refusal can say
`policy.yaml:12: tenants.acme.tokens_per_minute: ...`.

Invariants: JSON is parsed strictly by the json module (no YAML leniency leaks into what is
accepted); the locator is best effort (built from a YAML composition of the same text, JSON
being YAML's flow syntax) and answers None where it cannot tell, never raises.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FieldPath = tuple[str, ...]


class ConfigFileError(ValueError):
    """The file is unreadable or invalid; the message names the file, line and field."""


@dataclass(frozen=True)
class Locator:
    path: Path
    lines: dict[FieldPath, int] = field(default_factory=dict)

    def line_of(self, where: FieldPath) -> int | None:
        # The closest enclosing field that has a line: a missing field is reported at the
        # line of the mapping that should hold it.
        for end in range(len(where), -1, -1):
            line = self.lines.get(where[:end])
            if line is not None:
                return line
        return None

    def error(self, where: FieldPath, message: str) -> ConfigFileError:
        line = self.line_of(where)
        place = f"{self.path}:{line}" if line is not None else str(self.path)
        name = ".".join(where)
        return ConfigFileError(f"{place}: {name}: {message}" if name else f"{place}: {message}")


def read_document(path: Path) -> tuple[Any, Locator]:
    """(parsed data, locator); ConfigFileError for unreadable or unparsable text."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"{path}: cannot read: {e}") from e
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    if is_yaml:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise ConfigFileError(f"{path}{line}: not valid YAML: {e}") from e
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigFileError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from e
    return data, Locator(path, _field_lines(text))


def _field_lines(text: str) -> dict[FieldPath, int]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[FieldPath, int] = {}
    if root is not None:
        _walk(root, (), lines)
    return lines


def _walk(node: yaml.Node, where: FieldPath, lines: dict[FieldPath, int]) -> None:
    lines.setdefault(where, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                child = (*where, str(key.value))
                lines[child] = key.start_mark.line + 1
                _walk(value, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        items: Sequence[yaml.Node] = node.value
        for index, item in enumerate(items):
            _walk(item, (*where, str(index)), lines)
