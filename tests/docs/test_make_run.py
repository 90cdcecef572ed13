"""`make run` is what the README and docs say it is: `kvfleet demo` with no --model, so the
default model's own GGUF served directly, with no conversion step before it.

The Makefile's `run` target is read as make reads it (prerequisites, recipe); the docs are read
sentence by sentence: no sentence naming `make run` may still say it serves a converted copy,
and the model name clients must send (the GGUF file's name) is the one the docs give.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.models.default_model import GGUF_RELATIVE_PATH
from kvfleet.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/quantization.md")
# What a sentence about `make run` said while it served the dense conversion.
STALE = re.compile(r"converted|dense copy|Hugging Face(?:-format)? directory", re.IGNORECASE)


def makefile_target(text: str, name: str) -> tuple[list[str], list[str]]:
    """(prerequisites, recipe lines) of target `name` in a Makefile's text."""
    match = re.search(rf"^{re.escape(name)}:([^\n]*)\n((?:\t[^\n]*\n)*)", text, re.MULTILINE)
    assert match is not None, f"no target {name!r}"
    return match.group(1).split(), [line.strip() for line in match.group(2).splitlines()]


def stale_make_run_sentences(text: str) -> list[str]:
    """Sentences naming `make run` that describe it serving a converted model."""
    sentences = re.split(r"(?<=[.;:])\s+", " ".join(text.split()))
    return [s for s in sentences if "`make run`" in s and STALE.search(s)]


def test_the_checkers_catch_what_they_are_for() -> None:
    makefile = "run: model\n\t$(PY) -m kvfleet.cli demo\n\nother: run\n\techo x\n"
    assert makefile_target(makefile, "run") == (["model"], ["$(PY) -m kvfleet.cli demo"])
    text = ("`make run` keeps the converted\ndense model. `make run` serves the GGUF. "
            "Tests use the converted directory.")
    assert stale_make_run_sentences(text) == ["`make run` keeps the converted dense model."]


def test_make_run_is_kvfleet_demo_on_its_default_model_without_a_conversion() -> None:
    prerequisites, recipe = makefile_target((REPO_ROOT / "Makefile").read_text(), "run")
    assert "model" not in prerequisites  # `make model` is the dense conversion
    assert recipe == ["$(PY) -m kvfleet.cli demo"]
    assert build_parser().parse_args(["demo"]).model is None  # so: the default GGUF


def test_docs_describe_make_run_serving_the_gguf() -> None:
    served_name = Path(GGUF_RELATIVE_PATH).name
    for doc in DOCS:
        text = (REPO_ROOT / doc).read_text(encoding="utf-8")
        assert stale_make_run_sentences(text) == [], doc
        assert f"`{served_name}`" in text, f"{doc} does not name the model clients send"
