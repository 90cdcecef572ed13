"""`--chat-template`: a Jinja chat template given as a file or inline, as vLLM takes it.

Role: turn the flag's value into template source and check that it compiles, so a bad
template stops the service at start rather than failing every chat request.

A value naming an existing file is read from it; a value with template syntax or a line
break in it is the template itself; anything else is taken for a missing file (an error
that names it) rather than served as a template that prints a path.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

from kvfleet.text.tokenizer import compile_chat_template

_TEMPLATE_MARKS = ("{{", "{%", "{#", "\n")


def resolve_chat_template(value: str) -> str:
    """The template source `value` stands for; ValueError when it is neither a readable
    file nor a template that compiles."""
    path = Path(value).expanduser()
    if path.is_file():
        source = path.read_text(encoding="utf-8")
    elif any(mark in value for mark in _TEMPLATE_MARKS):
        source = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    try:
        compile_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not compile: {e}") from e
    return source
