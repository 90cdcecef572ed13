"""Reasoning parsers: reasoning and content of an output, the same for every split of it."""

from __future__ import annotations

import pytest

from router.openai.reasoning import new_reasoning_parser, reasoning_parser_names
from tests.unit.stream_splits import splits


def run(name: str, pieces: list[str]) -> tuple[str, str]:
    parser = new_reasoning_parser(name)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


CASES = [
    ("deepseek_r1", "<think>I think.</think>\n\nAnswer", ("I think.", "\n\nAnswer")),
    ("deepseek_r1", "I think.</think>Answer", ("I think.", "Answer")),
    ("deepseek_r1", "still thinking </thi", ("still thinking </thi", "")),
    ("deepseek_r1", "<thi", ("<thi", "")),
    ("deepseek_r1", "", ("", "")),
    ("qwen3", "<think>\nhmm\n</think>\n\nHi <think> there", ("\nhmm\n", "\n\nHi <think> there")),
    ("qwen3", "No thinking </think> here", ("", "No thinking </think> here")),
    ("qwen3", "<thin", ("", "<thin")),
    ("qwen3", "<think>cut off", ("cut off", "")),
]


@pytest.mark.parametrize("name,output,expected", CASES)
def test_reasoning_and_content_are_the_same_for_every_split(
    name: str, output: str, expected: tuple[str, str]
) -> None:
    assert run(name, [output]) == expected
    for pieces in splits(output):
        assert run(name, pieces) == expected, pieces


def test_a_partial_end_marker_is_held_back() -> None:
    parser = new_reasoning_parser("deepseek_r1")
    assert parser.feed("a</th").reasoning == "a"
    delta = parser.feed("ink>b")
    assert (delta.reasoning, delta.content) == ("", "b")


def test_registry() -> None:
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
