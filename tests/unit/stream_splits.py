"""Splits of a model output into stream pieces, for the parsers' split-invariance tests."""

from __future__ import annotations

import random
from collections.abc import Iterable


def splits(text: str) -> Iterable[list[str]]:
    """Every split in two and three pieces, then random token-sized ones."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(0, len(text) + 1, 3):
        for j in range(i, len(text) + 1, 2):
            yield [text[:i], text[i:j], text[j:]]
    rng = random.Random(len(text))
    for _ in range(50):
        pieces, at = [], 0
        while at < len(text):
            step = rng.randint(1, 6)
            pieces.append(text[at:at + step])
            at += step
        yield pieces
    yield list(text)
