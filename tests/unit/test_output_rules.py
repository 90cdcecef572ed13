"""The shared output rules (`kvfleet.text.output_rules`) on toy decoders, exact texts.

Covers: the stop-token rule; `SampleText` (held-back characters, prompt context, per-token
ends of several-token updates equal to one-token updates); `StopStringFilter` (held-back
prefixes, kept-token counts, min_tokens counted token by token, updates without ends, flush
at the end, nothing after a match); and the two together giving the same output whether
tokens arrive one by one or several at a time (speculative decoding).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvfleet.text.output_rules import (
    FilteredText,
    SampleText,
    StopStringFilter,
    TextDelta,
    text_token_ids,
)
from kvfleet.text.stop_strings import StopStringMatcher

EOS = 0


class ByteTokenizer:
    """Token i is byte i (UTF-8; a lone lead byte decodes to U+FFFD); token 0 is special."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if not (skip_special_tokens and i == EOS)]
        text = bytes(kept).decode("utf-8", errors="replace")
        return text.replace("\x00", "<eos>")


class WordTokenizer:
    """SentencePiece-like: words joined by spaces, so a word's space depends on its left."""

    WORDS = ["<eos>", "once", "upon", "a", "time"]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.WORDS[i] for i in ids if not (skip_special_tokens and i == EOS))


def utf8(text: str) -> list[int]:
    return list(text.encode())


def sample_text(split: bool = True, include: bool = False, skip: bool = True) -> SampleText:
    return SampleText(
        ByteTokenizer(),
        skip_special_tokens=skip,
        include_stop_str_in_output=include,
        split_by_token=split,
    )


def stop_filter(stop: list[str], min_tokens: int = 0, include: bool = False) -> StopStringFilter:
    return StopStringFilter(StopStringMatcher(stop, include), min_tokens)


def test_the_ending_stop_token_shows_no_text_unless_included():
    assert list(text_token_ids([5, 6, EOS], True, False)) == [5, 6]
    assert list(text_token_ids([5, 6, EOS], True, True)) == [5, 6, EOS]
    assert list(text_token_ids([5, 6, 7], False, False)) == [5, 6, 7]
    assert list(text_token_ids([], True, False)) == []


@pytest.mark.parametrize(("include", "expected"), [(False, "ab"), (True, "ab<eos>")])
def test_sample_text_drops_the_stop_token_only_when_it_ends_generation(include, expected):
    text = sample_text(include=include, skip=False)
    # Not finished: ends_on_stop_token has no effect (the id is ordinary text).
    assert text.add([EOS], finished=False, ends_on_stop_token=True).text == "<eos>"
    deltas = [text.add(utf8("a"), finished=False), text.add(utf8("b"), finished=False)]
    last = text.add([EOS], finished=True, ends_on_stop_token=True)
    assert "".join(d.text for d in [*deltas, last]) == expected
    assert last.token_ends == []


def test_sample_text_holds_a_character_back_until_it_is_whole():
    text = sample_text()
    e_acute = utf8("é")
    assert text.add(e_acute[:1], finished=False) == TextDelta("")
    assert text.add(e_acute[1:], finished=False) == TextDelta("é")
    # A split character at the end comes out (as U+FFFD) on the flush.
    assert text.add(e_acute[:1], finished=True) == TextDelta("\ufffd")


def test_sample_text_splits_several_tokens_as_one_token_updates_would():
    ids = utf8("aé b")  # 5 bytes: a, é (2), space, b
    pieces = []
    one = sample_text()
    for index, token in enumerate(ids):
        pieces.append(one.add([token], finished=index == len(ids) - 1).text)
    assert pieces == ["a", "", "é", " ", "b"]
    several = sample_text()
    first = several.add(ids[:3], finished=False)
    second = several.add(ids[3:], finished=True)
    assert first == TextDelta("aé", [1, 1, 2])  # ends count characters
    assert second == TextDelta(" b", [1, 2])
    # One token, or no splitting asked: one decode and no ends.
    assert sample_text().add(ids[:1], finished=False) == TextDelta("a")
    assert sample_text(split=False).add(ids, finished=True) == TextDelta("aé b")


def test_sample_text_split_gives_the_stop_token_an_empty_piece():
    text = sample_text()
    delta = text.add([*utf8("ab"), EOS], finished=True, ends_on_stop_token=True)
    assert delta == TextDelta("ab", [1, 2, 2])


def test_sample_text_reads_generated_words_after_the_prompt():
    def words(prompt: Sequence[int]) -> str:
        text = SampleText(
            WordTokenizer(),
            skip_special_tokens=True,
            include_stop_str_in_output=False,
            split_by_token=False,
            prompt_token_ids=prompt,
        )
        return text.add([3], finished=False).text + text.add([4], finished=True).text

    assert words([]) == "a time"
    assert words([1, 2]) == " a time"  # "once upon" + " a time"


def test_filter_without_stop_strings_passes_text_and_counts_tokens():
    filtered = StopStringFilter(StopStringMatcher([]), min_tokens=5)
    assert filtered.add("abc", [1, 2, 3], 3, False) == FilteredText("abc", 3)
    assert filtered.add("d", [], 1, True) == FilteredText("d", 1)
    assert (filtered.num_tokens, filtered.stop_string) == (4, None)


def test_filter_holds_back_a_possible_prefix_and_flushes_it_at_the_end():
    # The last len("xyz") - 1 characters wait: they could start "xyz".
    filtered = stop_filter(["xyz"])
    assert filtered.add("abx", [], 1, False) == FilteredText("a", 1)
    assert filtered.add("y", [], 1, False) == FilteredText("b", 1)
    assert filtered.add("q", [], 1, True) == FilteredText("xyq", 1)
    assert filtered.stop_string is None


@pytest.mark.parametrize(("include", "text"), [(False, "ab"), (True, "abST")])
def test_filter_keeps_tokens_up_to_the_one_completing_the_stop_string(include, text):
    filtered = stop_filter(["ST"], include=include)
    # Four tokens "a", "bS", "T", "c": the third completes "ST".
    kept = filtered.add("abSTc", [1, 3, 4, 5], 4, False)
    assert kept == FilteredText(text, 3)
    assert (filtered.stop_string, filtered.num_tokens) == ("ST", 3)
    # After the match nothing more is emitted or counted.
    assert filtered.add("more", [], 1, True) == FilteredText("", 0)
    assert filtered.num_tokens == 3


def test_filter_without_per_token_ends_keeps_the_whole_update():
    filtered = stop_filter(["ST"])
    assert filtered.add("abSTc", [], 4, False) == FilteredText("ab", 4)
    assert filtered.num_tokens == 4


def test_filter_checks_stop_strings_only_from_min_tokens_token_by_token():
    # "ab" completes at token 2 < min_tokens 3: plain text, and it never matches later.
    filtered = stop_filter(["ab"], min_tokens=3)
    kept = filtered.add("abxab", [1, 2, 3, 4, 5], 5, False)
    assert kept == FilteredText("abx", 5)
    assert (filtered.stop_string, filtered.num_tokens) == ("ab", 5)
    # The same tokens one update each match at the same token.
    singles = stop_filter(["ab"], min_tokens=3)
    out = [singles.add(c, [], 1, False) for c in "abxab"]
    assert "".join(k.text for k in out) == "abx" and [k.num_kept for k in out] == [1] * 5


@pytest.mark.parametrize("sizes", [[1] * 10, [3, 4, 3], [10], [2, 8]])
def test_sample_text_and_filter_give_the_same_output_however_tokens_are_grouped(sizes):
    ids = [*utf8("hé, stop"), EOS]  # é spans two tokens; EOS ends generation
    text = sample_text()
    filtered = stop_filter(["sto"], min_tokens=2)
    emitted, kept, start = [], 0, 0
    for n, size in enumerate(sizes):
        chunk, last = ids[start : start + size], n == len(sizes) - 1
        start += size
        delta = text.add(chunk, finished=last, ends_on_stop_token=last)
        out = filtered.add(delta.text, delta.token_ends, len(chunk), last)
        emitted.append(out.text)
        kept += out.num_kept
        if filtered.stop_string is not None:
            break
    # "sto" completes at the 8th token ("o"): tokens up to it are kept, text ends before it.
    assert ("".join(emitted), kept, filtered.stop_string) == ("hé, ", 8, "sto")
