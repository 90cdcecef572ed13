"""argparse `type=` converters shared by every service's command line.

Role: each bound on a flag's value is written once here, so the engine, router and tokenizer
services word the same mistake the same way ("must be at least 1, got 0"). Each converter
raises `argparse.ArgumentTypeError`, which argparse turns into a usage error naming the flag.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def non_negative_int(text: str) -> int:
    number = int(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return number


def non_negative_float(text: str) -> float:
    number = float(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return number


def seconds(text: str) -> float:
    """A finite, non-negative duration (nan and inf refused)."""
    number = float(text)
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return number


def port(text: str) -> int:
    number = int(text)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {number}")
    return number
