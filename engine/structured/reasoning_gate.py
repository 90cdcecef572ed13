"""A grammar that starts after the model's reasoning: `<think>...</think>` stays free text.

Role: with a reasoning parser on (the router's `--reasoning-parser`), a structured-output
constraint applies to the content, not to the reasoning before it (vLLM does the same). The
router then sets `StructuredOutputsParams.reasoning_end` (and `reasoning_start` for parsers
whose reasoning is optional); `ReasoningGate` wraps the sample's grammar matcher:

- before the end marker, every token is allowed (the mask is all ones: greedy tokens equal
  unconstrained decoding's) and the grammar consumes nothing;
- the end marker is found in the output's bytes (as the tokenizer decodes each token, so a
  marker split over several tokens, or preceded by a space in the same token, is found): the
  grammar then follows every later token, from the next one;
- `reasoning_start` (qwen3's parser: reasoning only when the output opens with `<think>`):
  at the first output token the mask is the grammar's plus the start marker's token; the
  marker opens the reasoning, any other token is the grammar's first. A start marker the
  tokenizer spells with several tokens cannot be offered this way: the grammar then applies
  from the first token (no reasoning), so the output is always valid.

Invariants: the wrapper keeps one history entry per accepted token, so `rollback` (after
speculative drafts) restores exactly the state before them, on either side of the marker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.structured.backend import GrammarMatcher

# Where a sample is: before its first token (start marker optional), reasoning, or content.
_UNDECIDED, _REASONING, _CONTENT = "undecided", "reasoning", "content"


@dataclass(frozen=True)
class ReasoningMarkers:
    end: bytes
    # The start marker's single token id when reasoning is optional (None: reasoning from the
    # first token, the prompt opened it).
    start_token: int | None = None
    # True when the start marker was asked for but is not one token: no reasoning at all.
    content_only: bool = False


@dataclass
class _State:
    phase: str
    # The last bytes seen while reasoning, shorter than the end marker (a marker may span
    # several tokens).
    tail: bytes = b""


class ReasoningGate:
    def __init__(self, inner: GrammarMatcher, markers: ReasoningMarkers,
                 token_bytes: Callable[[int], bytes]) -> None:
        self._inner = inner
        self._markers = markers
        self._token_bytes = token_bytes
        if markers.content_only:
            first = _CONTENT
        else:
            first = _UNDECIDED if markers.start_token is not None else _REASONING
        self._state = _State(first)
        # Per accepted token: the state before it, and whether the grammar consumed it.
        self._history: list[tuple[_State, bool]] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        phase = self._state.phase
        if phase == _CONTENT:
            self._inner.fill_bitmask(bitmask, row)
        elif phase == _REASONING:
            bitmask[row] = -1
        else:
            self._inner.fill_bitmask(bitmask, row)
            start = self._markers.start_token
            assert start is not None
            bitmask[row, start // 32] |= _bit(start % 32)

    def accept_token(self, token_id: int) -> bool:
        before = _State(self._state.phase, self._state.tail)
        consumed = self._next_is_content(token_id)
        accepted = self._inner.accept_token(token_id) if consumed else True
        if consumed:
            self._state = _State(_CONTENT)
        else:
            self._advance_reasoning(token_id)
        self._history.append((before, consumed))
        return accepted

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        # Simulated on the wrapper's own state, rolled back after: the inner matcher answers
        # for the tokens past the marker without consuming them.
        taken = 0
        for token_id in token_ids:
            if self._next_is_content(token_id):
                valid = self._inner.validate_tokens(token_ids[taken:])
                self.rollback(taken)
                return taken + valid
            self.accept_token(token_id)
            taken += 1
        self.rollback(taken)
        return taken

    def rollback(self, num_tokens: int) -> None:
        inner = 0
        for _ in range(num_tokens):
            before, consumed = self._history.pop()
            self._state = before
            inner += consumed
        self._inner.rollback(inner)

    @property
    def is_terminated(self) -> bool:
        return self._state.phase == _CONTENT and self._inner.is_terminated

    @property
    def error(self) -> str:
        return self._inner.error

    def _next_is_content(self, token_id: int) -> bool:
        phase = self._state.phase
        return phase == _CONTENT or (phase == _UNDECIDED and token_id != self._markers.start_token)

    def _advance_reasoning(self, token_id: int) -> None:
        seen = self._state.tail + self._token_bytes(token_id)
        end = self._markers.end
        if end in seen:
            self._state = _State(_CONTENT)
        else:
            self._state = _State(_REASONING, seen[-(len(end) - 1):] if len(end) > 1 else b"")


def _bit(position: int) -> int:
    # Bit 31 of an int32 word is its sign bit.
    return -(1 << 31) if position == 31 else 1 << position


def markers_for(start: str | None, end: str, tokenize: Callable[[str], list[int]]
                ) -> ReasoningMarkers:
    """The gate's markers for a request's `reasoning_start`/`reasoning_end` strings."""
    if start is None:
        return ReasoningMarkers(end.encode())
    start_ids = tokenize(start)
    if len(start_ids) != 1:
        return ReasoningMarkers(end.encode(), content_only=True)
    return ReasoningMarkers(end.encode(), start_token=start_ids[0])
