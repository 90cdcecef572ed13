"""engine.structured.reasoning_gate on a scripted inner matcher: masks, phases, rollback.

Tokens are single bytes of a toy vocabulary (id = byte value, 64 ids); the inner matcher
accepts only digits and records what it consumed, so every assertion is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.structured import bitmask
from engine.structured.reasoning_gate import ReasoningGate, ReasoningMarkers, markers_for

VOCAB = 128
DIGITS = [ord(c) for c in "0123456789"]
START = 1  # a one-token start marker ("<think>" in the toy)


class Digits:
    """Accepts digits only; terminated after three."""

    def __init__(self) -> None:
        self.consumed: list[int] = []

    def fill_bitmask(self, packed: torch.Tensor, row: int) -> None:
        packed[row] = 0
        for token in DIGITS:
            packed[row, token // 32] |= 1 << (token % 32)

    def accept_token(self, token_id: int) -> bool:
        if token_id not in DIGITS:
            return False
        self.consumed.append(token_id)
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        valid = 0
        for token in token_ids:
            if token not in DIGITS or len(self.consumed) + valid >= 3:
                break
            valid += 1
        return valid

    def rollback(self, num_tokens: int) -> None:
        del self.consumed[len(self.consumed) - num_tokens:]

    @property
    def is_terminated(self) -> bool:
        return len(self.consumed) >= 3

    @property
    def error(self) -> str:
        return ""


def token_bytes(token_id: int) -> bytes:
    return b"<think>" if token_id == START else bytes([token_id])


def allowed(gate: ReasoningGate) -> list[int]:
    packed = bitmask.allocate(1, VOCAB)
    gate.fill_bitmask(packed, 0)
    return [i for i, ok in enumerate(bitmask.unpack(packed, VOCAB)[0].tolist()) if ok]


def feed(gate: ReasoningGate, text: str) -> None:
    for char in text:
        assert gate.accept_token(ord(char))


def test_everything_is_allowed_until_the_end_marker_then_the_grammar() -> None:
    inner = Digits()
    gate = ReasoningGate(inner, ReasoningMarkers(b"</t>"), token_bytes)
    assert allowed(gate) == list(range(VOCAB))
    feed(gate, "hm 12 </")  # digits while reasoning are not the grammar's
    assert allowed(gate) == list(range(VOCAB)) and inner.consumed == []
    feed(gate, "t>")  # the marker, split over tokens, ends the reasoning
    assert allowed(gate) == DIGITS and not gate.is_terminated
    feed(gate, "123")
    assert inner.consumed == DIGITS[1:4] and gate.is_terminated


def test_rollback_and_validation_cross_the_marker_exactly() -> None:
    inner = Digits()
    gate = ReasoningGate(inner, ReasoningMarkers(b"</t>"), token_bytes)
    feed(gate, "ab</")
    drafts = [ord(c) for c in "t>12x"]
    assert gate.validate_tokens(drafts) == 4  # "t>" free, "12" digits, "x" refused
    assert inner.consumed == [] and allowed(gate) == list(range(VOCAB))
    feed(gate, "t>12")
    gate.rollback(3)  # back to after "t": still reasoning, the grammar empty
    assert inner.consumed == [] and allowed(gate) == list(range(VOCAB))
    feed(gate, ">7")
    assert inner.consumed == [ord("7")]


def test_an_optional_start_offers_its_token_beside_the_grammars_first() -> None:
    gate = ReasoningGate(Digits(), ReasoningMarkers(b"</t>", start_token=START), token_bytes)
    assert allowed(gate) == sorted([START, *DIGITS])
    assert gate.accept_token(START)  # reasoning opens
    assert allowed(gate) == list(range(VOCAB))
    inner = Digits()
    gate = ReasoningGate(inner, ReasoningMarkers(b"</t>", start_token=START), token_bytes)
    feed(gate, "4")  # no reasoning: the first token is the grammar's
    assert inner.consumed == [ord("4")] and allowed(gate) == DIGITS


def test_a_start_marker_of_several_tokens_means_no_reasoning() -> None:
    assert markers_for("<think>", "</think>", lambda s: [1, 2]) == ReasoningMarkers(
        b"</think>", content_only=True)
    assert markers_for("<think>", "</think>", lambda s: [7]) == ReasoningMarkers(
        b"</think>", start_token=7)
    assert markers_for(None, "</think>", lambda s: [7]) == ReasoningMarkers(b"</think>")
    gate = ReasoningGate(Digits(), markers_for("<a>", "</a>", lambda s: [1, 2]), token_bytes)
    assert allowed(gate) == DIGITS
