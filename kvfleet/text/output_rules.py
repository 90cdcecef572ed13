"""The rules that turn a sample's generated tokens into its output text, written once.

Role: every output path applies the same vLLM rules, so they live here and the paths only
adapt their own types: the offline API (`engine.completion_tracker`), the engine service's
Generate stream (`engine.service.output_text`) and the router's relay of engine streams
(`router.engines.stream_relay`). Two halves, because the engine detokenizes and the router
applies stop strings, with a proto message between them:

- `SampleText` detokenizes a sample's tokens as they arrive (`IncrementalDetokenizer`,
  optionally with the prompt's tail as left context) and applies the stop-token rule;
  `text_token_ids` is that rule alone, for a path that decodes all ids at once.
- `StopStringFilter` consumes that text, token by token, and applies stop strings
  (`StopStringMatcher`) and min_tokens.

Invariants:
- The EOS or stop token that ends generation stays in token_ids but adds no text, unless
  include_stop_str_in_output (vLLM).
- The texts of one sample's updates concatenate to the text its ids add (after the prompt,
  with prompt context); no piece ends inside a character; the last update flushes.
- With `split_by_token`, an update of several tokens (speculative decoding) is detokenized
  one token at a time, exactly as one-token updates would be, and `TextDelta.token_ends`
  says where each token's text ends. One-token updates, and updates without it, are one
  decode and carry no ends (a stream without stop strings pays no per-token decode).
- Stop strings are checked only once `min_tokens` tokens exist, counted token by token;
  text that could still start a stop string is held back. Given ends for every token of an
  update, matching goes token by token, so a stop string completed inside an update keeps
  the tokens up to the one completing it (`FilteredText.num_kept`) and drops the rest, as
  one-token updates would; without ends the update is one piece and all its tokens count.
- After a stop string matched, the filter emits nothing more and counts no more tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfleet.text.incremental import Decoder, IncrementalDetokenizer
from kvfleet.text.stop_strings import StopStringMatcher


def text_token_ids(
    token_ids: Sequence[int], ends_on_stop_token: bool, include_stop_str_in_output: bool
) -> Sequence[int]:
    """The ids whose text shows: all but the ending EOS / stop token (vLLM).

    `ends_on_stop_token`: `token_ids` are the sample's last, and generation ended because
    the last one is an EOS or stop token (finish_reason "stop", not a stop string).
    """
    if ends_on_stop_token and token_ids and not include_stop_str_in_output:
        return token_ids[:-1]
    return token_ids


@dataclass(frozen=True)
class TextDelta:
    """The text one update adds and, for several tokens split by token, each token's end."""

    text: str
    token_ends: list[int] = field(default_factory=list)


class SampleText:
    """One sample's text as its tokens arrive: `add(ids, ...)` is the text they add."""

    def __init__(
        self,
        tokenizer: Decoder,
        *,
        skip_special_tokens: bool,
        include_stop_str_in_output: bool,
        split_by_token: bool,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens, prompt_token_ids
        )
        self._keep_stop_token = include_stop_str_in_output
        self._split_by_token = split_by_token

    def add(
        self, token_ids: Sequence[int], *, finished: bool, ends_on_stop_token: bool = False
    ) -> TextDelta:
        """The text `token_ids` add; `finished`: they are the sample's last (flush).

        `ends_on_stop_token`: generation ended on the last of them, an EOS / stop token.
        """
        shown = text_token_ids(token_ids, finished and ends_on_stop_token, self._keep_stop_token)
        if not self._split_by_token or len(token_ids) <= 1:
            return TextDelta(self._decode(shown, finished))
        pieces: list[str] = []
        ends: list[int] = []
        end = 0
        for index in range(len(token_ids)):
            last = index == len(token_ids) - 1
            # The stop token's slice is empty when it adds no text: it still gets its end.
            piece = self._decode(shown[index : index + 1], finished and last)
            pieces.append(piece)
            end += len(piece)
            ends.append(end)
        return TextDelta("".join(pieces), ends)

    def _decode(self, token_ids: Sequence[int], finished: bool) -> str:
        text = self._detokenizer.add_tokens(token_ids)
        if finished:
            text += self._detokenizer.flush()
        return text


@dataclass(frozen=True)
class FilteredText:
    """What one update leaves in the output once stop strings are applied."""

    text: str  # to emit now (held-back text comes later, or never after a stop string)
    num_kept: int  # the update's tokens that stay in the output: all, unless a stop string


class StopStringFilter:
    """Stop strings and min_tokens over a sample's text, token by token.

    Without stop strings it passes text through and only counts tokens.
    """

    def __init__(self, matcher: StopStringMatcher, min_tokens: int = 0) -> None:
        self._matcher = matcher
        self._min_tokens = min_tokens
        self._num_tokens = 0

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, once one matched."""
        return self._matcher.matched

    @property
    def num_tokens(self) -> int:
        """Tokens in the output so far: after a match, up to the one that completed it."""
        return self._num_tokens

    def add(
        self, text: str, token_ends: Sequence[int], num_tokens: int, finished: bool
    ) -> FilteredText:
        """Apply stop strings to one update: `num_tokens` tokens adding `text`, where
        `token_ends` (if one per token) says where each token's text ends; `finished`: the
        sample's last update (held-back text is flushed unless a stop string matched)."""
        if self._matcher.matched is not None:
            return FilteredText("", 0)
        if not self._matcher.active or len(token_ends) != num_tokens or num_tokens <= 1:
            # No stop strings, one token (or none), or no ends: the update is one piece.
            emitted, num_kept = self._add_piece(text, num_tokens), num_tokens
        else:
            emitted, num_kept = self._add_per_token(text, token_ends)
        if finished and self._matcher.matched is None:
            emitted += self._matcher.flush()
        return FilteredText(emitted, num_kept)

    def _add_per_token(self, text: str, token_ends: Sequence[int]) -> tuple[str, int]:
        emitted: list[str] = []
        start = 0
        for index, end in enumerate(token_ends):
            emitted.append(self._add_piece(text[start:end], 1))
            start = end
            if self._matcher.matched is not None:
                return "".join(emitted), index + 1
        return "".join(emitted), len(token_ends)

    def _add_piece(self, text: str, num_tokens: int) -> str:
        # A stop string found before min_tokens tokens exist is ordinary text (vLLM).
        self._num_tokens += num_tokens
        return self._matcher.add(text, self._num_tokens >= self._min_tokens)
